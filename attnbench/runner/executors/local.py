"""Executors run cells and hand back rows: in this process, or each cell in a fresh subprocess.

The Ray executor (``attnbench.runner.executors.ray``) has the same interface: ``execute(cells, on_row)``
calls ``on_row(row)`` as each cell finishes and returns when all are done or the run is interrupted.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from attnbench.results.schema import Cell, empty_row, normalise_row
from attnbench.runner.cell import run_cell
from attnbench.runner.sweep import Settings

OnRow = Callable[[Cell, dict], None]
STARTUP_GRACE_S = 20.0


def run_in_subprocess(cell: Cell, settings: Settings, run_id: str = "", peak_gflops_per_s: float | None = None) -> dict:
    """Run one cell in a child interpreter and return its row (a status row if the child dies).

    ``peak_gflops_per_s`` (the device's measured peak, when known) is handed to the child so that it
    does not measure it again inside the cell's time window.
    """
    with tempfile.TemporaryDirectory(prefix="attnbench-cell-") as tmp:
        out = Path(tmp) / "row.json"
        payload = json.dumps({"cell": asdict(cell), "settings": asdict(settings), "run_id": run_id, "out": str(out),
                              "peak_gflops_per_s": peak_gflops_per_s})
        # The child times out Python-level hangs itself (a clean `timeout` row); the parent kills it
        # when a hang in native code keeps it past the deadline plus start-up (interpreter, torch import).
        timeout = settings.cell_timeout_s + STARTUP_GRACE_S if settings.cell_timeout_s else None
        try:
            proc = subprocess.run([sys.executable, "-m", "attnbench.runner.executors.worker"], input=payload, text=True,
                                  capture_output=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            row = empty_row(cell, run_id)
            row.update(status="timeout", error=f"cell exceeded its timeout of {settings.cell_timeout_s:g} s; "
                                               "the worker process was killed", worker="subprocess")
            return row
        if proc.returncode == 0 and out.is_file():
            return normalise_row(json.loads(out.read_text()))
        row = empty_row(cell, run_id)
        if proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = f"signal {-proc.returncode}"
            why = f"worker process died with {sig}"
        else:
            why = f"worker process exited with code {proc.returncode}"
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        row.update(status="error", error=why + (": " + " | ".join(tail) if tail else ""), worker="subprocess")
        return row


class _SerialExecutor:
    """Cells one after another; each becomes a row through ``run_one(cell, settings, run_id)``."""

    name = "serial"
    run_one: Callable[[Cell, Settings, str], dict]

    def __init__(self, settings: Settings, run_id: str):
        self.settings, self.run_id = settings, run_id

    def execute(self, cells: Iterable[Cell], on_row: OnRow, on_start: Callable[[Cell], None] | None = None) -> None:
        for cell in cells:
            if on_start:
                on_start(cell)
            on_row(cell, self.run_one(cell, self.settings, self.run_id))


class LocalExecutor(_SerialExecutor):
    """Cells one after another in this process (timeouts interrupt Python-level hangs only)."""

    name = "local"
    run_one = staticmethod(run_cell)


class SubprocessExecutor(_SerialExecutor):
    """Each cell in a fresh ``python -m attnbench.runner.executors.worker`` process.

    A crash (segfault, abort, os._exit) becomes an ``error`` row naming the signal or exit code; a
    cell past ``cell_timeout_s`` is killed and becomes a ``timeout`` row. Costs one interpreter and
    torch import per cell (about two seconds).
    """

    name = "subprocess"

    def __init__(self, settings: Settings, run_id: str):
        super().__init__(settings, run_id)
        self.peaks: dict[tuple[str, str], float] = {}  # (device, dtype) -> GFLOP/s, measured by the first ok cell

    def run_one(self, cell: Cell, settings: Settings, run_id: str) -> dict:
        """One cell in a fresh process; the peak GFLOP/s is measured once per run and device/dtype, then passed on."""
        key = (cell.device, cell.dtype)
        row = run_in_subprocess(cell, settings, run_id, peak_gflops_per_s=self.peaks.get(key))
        peak = row.get("peak_gflops_per_s")
        if key not in self.peaks and isinstance(peak, float) and math.isfinite(peak) and peak > 0:
            self.peaks[key] = peak
        return row
