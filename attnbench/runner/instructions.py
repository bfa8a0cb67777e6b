"""``attnbench run --metric instructions``: every cell of a sweep counted (instructions per call) instead of timed.

Each cell is counted in a process of its own under valgrind (:func:`attnbench.measure.instructions.count_cell`), one
after the other, and becomes one results row: ``ok`` with ``instructions`` and the other instruction columns (the
timing columns stay NaN: nothing was timed), ``skipped`` with the reason when it cannot be counted here (no
valgrind, a CUDA cell, a combination the implementation does not support), ``timeout`` or ``error`` when the count
failed. The run folder is an ordinary one (``meta.json`` says ``"metric": "instructions"``), so ``attnbench compare``
reads it like any other.

Counting takes no measurement lock: an instruction count does not change with the machine's load, and it does not
disturb a timing beside it more than any other process on a spare core would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from attnbench import environment
from attnbench.measure.instructions import ISA_ENV, CountError, CountSettings, CountTimeout, count_cell, unavailable_reason
from attnbench.resolve import Skip
from attnbench.results.schema import Cell, clear_measurements
from attnbench.results.store import RunStore, load_run
from attnbench.runner.cell import resolve_row, start_row
from attnbench.runner.session import sweep_to_dict
from attnbench.runner.sweep import Sweep

METRICS = ("time", "instructions")


def count_row(cell: Cell, settings: CountSettings, run_id: str = "") -> dict:
    """The results row of ``cell`` counted (never raises for a problem of the cell: the status says it)."""
    row = start_row(cell, run_id)
    t0 = time.perf_counter()
    if not isinstance(resolve_row(cell, row), Skip):
        reason = unavailable_reason(cell.device)
        if reason:
            row.update(status="skipped", error=reason)
        else:
            _count_into(row, cell, settings)
    if row["status"] != "ok":
        clear_measurements(row)
    row["duration_s"] = time.perf_counter() - t0
    row["timeout_s"] = settings.timeout_s
    return row


def _count_into(row: dict, cell: Cell, settings: CountSettings) -> None:
    try:
        row.update(count_cell(cell, settings))
    except CountTimeout as exc:
        row.update(status="timeout", error=str(exc))
    except (CountError, OSError, RuntimeError, ValueError) as exc:
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:800])
    else:
        row.update(status="ok", threads=1, notes=f"instructions counted under callgrind: {row['instr_settings']}")


def count_sweep(sweep: Sweep, out: str | Path, settings: CountSettings = CountSettings(), argv: list[str] | None = None,
                progress: Callable[[int, int, Cell, dict | None], None] | None = None) -> pd.DataFrame:
    """Count every cell of ``sweep`` into a new run folder under ``out``; its results (``attrs["run_dir"]``,
    ``attrs["run_id"]``, ``attrs["interrupted"]`` as :func:`attnbench.runner.engine.run`'s)."""
    cells = sweep.cells()
    meta = environment.collect(argv)
    meta.update(metric="instructions", sweep=sweep_to_dict(sweep), executor="callgrind",
                instruction_settings=asdict(settings), instruction_env=ISA_ENV[settings.capability])
    interrupted = False
    t0 = time.perf_counter()
    with RunStore(out, meta=meta) as store:
        try:
            for i, cell in enumerate(cells):
                if progress:
                    progress(i, len(cells), cell, None)
                row = count_row(cell, settings, store.run_id)
                store.append(row)
                if progress:
                    progress(i + 1, len(cells), cell, row)
        except KeyboardInterrupt:
            interrupted = True
        store.meta.update(wall_s=time.perf_counter() - t0, interrupted=interrupted)
        store.write_meta()
        store.finalize()
        run_dir, run_id = store.path, store.run_id
    df, _ = load_run(run_dir)
    df.attrs.update(run_dir=str(run_dir), run_id=run_id, interrupted=interrupted, interrupted_by=None)
    return df
