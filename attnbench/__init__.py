"""attnbench: is a multi-head attention implementation correct, how fast is it, how much memory does it take.

Python API (the CLI is a thin layer over it)::

    import attnbench
    attnbench.list_implementations()            # names registered here
    impl = attnbench.get("weight_split")        # an Implementation: build(), capabilities
    report = attnbench.check(["sdpa"])          # the correctness matrix, as a DataFrame
    df = attnbench.run(impl=["sdpa"], seq_len=[128, 256])   # a sweep, tidy results
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_HOME = {
    **dict.fromkeys(("AttnbenchError", "InputShapeError", "InvalidSpecError", "PluginLoadError", "ResultsError",
                     "SweepError", "UnavailableError", "UnknownImplementationError"), "errors"),
    "Implementation": "registry", "get": "registry", "register": "registry", "list_implementations": "registry",
    "AttnSpec": "spec", "CacheObject": "plugins.cache_objects",
    **dict.fromkeys(("Adapter", "CanonicalWeights", "export_weights", "load_weights", "random_weights"), "weights"),
}
"""The API's names -> the module that defines them, imported on first use (PEP 562): the ``attnbench`` command
starts its measuring worker before this process imports torch (:mod:`attnbench.runner.executors.ahead`)."""
_RENAMED = {"list_implementations": "names"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


def check(impls=None, **kwargs):
    """Run the correctness matrix (see :func:`attnbench.correctness.matrix.run_matrix`): a DataFrame
    (:class:`attnbench.results.notebook.CheckResults`) that a notebook shows as the check's summary table."""
    from attnbench.correctness.matrix import cases, run_matrix
    from attnbench.results.notebook import CheckResults, in_notebook, notebook_progress

    impls = list(impls) if impls else None
    if kwargs.get("progress") is None and in_notebook():
        from attnbench.registry import available

        n_impls = len(impls) if impls else len(available(kwargs.get("device", "cpu")))
        kwargs["progress"] = notebook_progress("case", total=n_impls * len(cases(kwargs.get("kinds"))))
    return CheckResults.of(run_matrix(impls, **kwargs))


def run(*args, **kwargs):
    """Run a sweep and return its tidy DataFrame (see :func:`attnbench.runner.engine.run`):
    :class:`attnbench.results.notebook.RunResults`, with ``plot(...)`` and ``report()``, shown in a notebook as the
    console's summary table and the headline speed-ups."""
    from attnbench.results.notebook import RunResults, in_notebook, notebook_progress
    from attnbench.runner.engine import run as _run

    if kwargs.get("progress") is None and in_notebook():
        kwargs["progress"] = notebook_progress("cell")
    return RunResults.of(_run(*args, **kwargs))


__all__ = [
    "Adapter", "AttnSpec", "AttnbenchError", "CacheObject", "CanonicalWeights", "Implementation", "InputShapeError",
    "InvalidSpecError", "PluginLoadError", "ResultsError", "SweepError", "UnavailableError",
    "UnknownImplementationError", "check", "export_weights", "get", "list_implementations", "load_weights",
    "random_weights", "register", "run",
]
