"""The one interface every executor has, and the unit of work it receives.

An :class:`Executor` measures :class:`WorkUnit` s and hands back one row per cell as each finishes:

* ``execute(units, on_row, on_start)`` calls ``on_start(cell)`` when a cell starts and ``on_row(cell, row)``
  when its row is ready, and returns when every unit is done (Ctrl-C propagates; finished rows are kept);
* ``close()`` ends whatever the executor started (worker processes, a private Ray instance);
* ``environment()`` says where the rows were measured: ``{"workers": [...], "nodes": [...]}`` (what each
  measuring process found in itself; one ``environment.collect()`` per Ray node), for ``meta.json``.

Three implement it: :class:`~attnbench.runner.executors.local.InProcessExecutor` (this process),
:class:`~attnbench.runner.executors.local.WorkerExecutor` (measuring worker processes under the controlled
CPU environment; ``attnbench run``'s default) and :class:`~attnbench.runner.executors.ray.RayExecutor`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from attnbench.results.schema import Cell

OnRow = Callable[[Cell, dict], None]
OnStart = Callable[[Cell], None]


@dataclass(frozen=True)
class WorkUnit:
    """What an executor measures in one go: the cells of one comparison group (cells that differ only in the
    implementation; one cell when nothing is compared), in one round, in measuring process ``process``."""

    cells: tuple[Cell, ...]
    process: int = 0
    round: int = 0

    def __post_init__(self) -> None:
        if not self.cells:
            raise ValueError("a work unit needs at least one cell")


@runtime_checkable
class Executor(Protocol):
    """Measures work units and hands back rows (see the module docstring)."""

    name: str

    def execute(self, units: Iterable[WorkUnit], on_row: OnRow, on_start: OnStart | None = None) -> None:
        """Measure every unit; ``on_row(cell, row)`` as each cell's row is ready."""

    def close(self) -> None:
        """End what this executor started (idempotent)."""

    def environment(self) -> dict:
        """``{"workers": [...], "nodes": [...]}``: where the rows were measured."""
