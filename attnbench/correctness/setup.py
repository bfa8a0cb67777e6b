"""Before any case runs: resolve an implementation name, check it can run on the device, build it and map its
weights once, so a broken import, constructor or weight mapping is one line, not one failure per case.

Shared by ``attnbench check`` and the pytest plug-in (:mod:`attnbench.testing.plugin`).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sysconfig

from attnbench import registry
from attnbench.correctness.cases import computes_mla
from attnbench.correctness.matrix import SHAPES
from attnbench.correctness.mla_cases import MLA_SHAPES
from attnbench.errors import CellTimeout, PluginLoadError, UnavailableError
from attnbench.plugins import preflight


def available(name: str, device: str) -> registry.Implementation:
    """The implementation called ``name``; :class:`UnavailableError` when it cannot run on ``device`` here."""
    impl = registry.get(name)  # an unknown name or a plug-in that does not import fails here
    reason = impl.unavailable_reason(device)
    if reason:
        raise UnavailableError(f"{name} cannot run on {device} here: {reason}; choose another --device or implementation")
    return impl


def prepared(impl: registry.Implementation, device: str) -> list[str]:
    """Construct ``impl`` and map its weights once (raises the setup error); the lines ``check -v`` prints."""
    shapes = MLA_SHAPES if computes_mla(impl) else SHAPES  # issue 46: an MLA built-in builds for MLA specs only
    return preflight(impl, device, other_specs=[shape.spec for shape in shapes])


SETUP_FLOOR_S = 120.0
"""How long one implementation's setup (its import, construction and the probes that read it) may take before it is
stopped as a hang when no case timeout is given: the floor of a cell's (``runner.budget.FLOOR_S``)."""


SETUP_MIN_S = 10.0
"""The least a setup gets under an explicit case timeout: probes run a few dozen small forwards, a case one."""


def setup_seconds(case_timeout) -> float | None:
    """The bound on one implementation's setup for ``check``'s ``--case-timeout`` value: the value given, at least
    :data:`SETUP_MIN_S` (``none``: unbounded), :data:`SETUP_FLOOR_S` for ``"auto"``."""
    if case_timeout == "auto":
        return SETUP_FLOOR_S
    return None if case_timeout is None else max(float(case_timeout), SETUP_MIN_S)


@contextlib.contextmanager
def bounded(name: str, seconds: float | None):
    """Stop the block after ``seconds`` (a constructor or a probe's forward that never returns) and raise a
    :class:`PluginLoadError` that names the line of the class's code it was stopped at."""
    from attnbench.runner.cell import deadline

    stopped: list = []
    try:
        with deadline(seconds, stopped):
            yield
    except CellTimeout:
        where = _user_line(stopped[0]) if stopped else None
        at = f": stopped at {where}" if where else ""
        raise PluginLoadError(
            f"{name} did not finish its setup (import, construction, the probes that read it) within {seconds:g} s"
            f"{at}; a constructor or forward that does not return cannot be checked (--case-timeout SECONDS, or "
            "none, changes the bound)") from None

_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _user_line(frame) -> str | None:
    """``file.py:42 "code" in f()`` of the innermost frame of ``frame``'s stack outside torch, attnbench and the
    standard library (the class's own line), or ``None``."""
    import torch

    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(registry.__file__) + os.sep, _STDLIB)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(skip) and not path.startswith("<"):
            rel = os.path.relpath(path)
            shown = path if rel.startswith("..") else rel
            return f'{shown}:{frame.f_lineno} "{linecache.getline(path, frame.f_lineno).strip()}" in {frame.f_code.co_name}()'
        frame = frame.f_back
    return None
