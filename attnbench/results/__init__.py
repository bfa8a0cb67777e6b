"""Results: the row schema, the run store on disk, and the comparison of two runs.

``load_run`` and ``read_meta`` are imported from :mod:`attnbench.results.store` on first use (PEP 562), so that a
measuring process, which needs only the row schema, does not import pandas and pyarrow (a second of its start-up).
"""

from __future__ import annotations

__all__ = ["load_run", "read_meta"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from attnbench.results import store

    value = getattr(store, name)
    globals()[name] = value
    return value
