"""The correctness matrix as pytest tests: one item per case, for any implementation name.

In a test file::

    import attnbench.testing

    test_mine = attnbench.testing.matrix("my_pkg.attn:MyAttention")

or on the command line, with no test file at all: ``python -m pytest --attnbench my.py:MyAttention``.
Both run exactly the cases ``attnbench check`` runs (:func:`attnbench.correctness.matrix.cases`), with the
messages it prints (:func:`attnbench.correctness.matrix.case_line`); the pytest plug-in that collects them is
:mod:`attnbench.testing.plugin` (registered as a ``pytest11`` entry point, so installing attnbench enables it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Matrix:
    """The correctness matrix of one implementation, as a test-file attribute the plug-in collects (one item per case)."""

    impl: str
    device: str = "cpu"
    kinds: tuple[str, ...] | None = None
    seed: int = 0


def matrix(impl: str, device: str = "cpu", kinds: Iterable[str] | None = None, seed: int = 0) -> Matrix:
    """``impl``'s correctness matrix as pytest items: assign it to a ``test_*`` name in a test file.

    ``impl`` is any name ``attnbench check`` accepts (``sdpa``, ``path/to/file.py:Class``,
    ``package.module:Class``, ``SHORT=target``); ``kinds`` runs only those case kinds; ``seed`` as ``check --seed``.
    """
    return Matrix(impl, device, tuple(kinds) if kinds is not None else None, seed)


__all__ = ["Matrix", "matrix"]
