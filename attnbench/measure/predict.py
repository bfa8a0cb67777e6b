"""``attnbench run --predict``: a sweep's duration and each cell's time, before running it, from earlier runs on this
machine (issue 49).

The earlier runs are the newest :data:`MAX_RUNS` run folders under the results folder (``--out``) whose ``meta.json``
names this machine (host name, CPU model and count). From their rows (the newest run's row of a cell that ran more
than once) come:

* a cell's **call time** (one call's median): the same cell's measured median when an earlier run had it, else the
  cost model of its implementation, device, dtype and mode (:mod:`attnbench.measure.costmodel`, fitted on every
  earlier cell of the group), else none (said);
* a cell's **wall time**: not its call time: building and the first call (a compile for ``compiled:``), the warm-up,
  the timed cycles until the CI is reached or the budget spent, the memory and FLOP pass and the accuracy pass: the
  row's ``duration_s`` (its own steps and its share of its comparison group's timed cycles, summed over rounds; the
  sum of its phase columns where a run lacks it), per unit (a round in a process), times the units of the new sweep.
  A cell not run before gets the cost model of the wall times of its group, else its implementation's median, else
  every cell's median;
* the **run's fixed time**: the newest earlier run's start-up, measuring workers' start-up and report (``meta.json``'s
  ``phases``), and its bookkeeping per cell times the new sweep's cells. Time waited for the machine's measurement
  lock is not predicted.

The estimate assumes the measurement settings of the earlier runs (budget, target CI); it says when they differ.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from attnbench.measure import costmodel

PHASE_COLUMNS = ("phase_build_s", "phase_warmup_s", "phase_timed_s", "phase_work_s", "phase_accuracy_s")
"""A row's own share of its run's wall time (:mod:`attnbench.runner.phases`): where ``duration_s`` is missing."""
FIXED_PHASES = ("start-up", "workers")
"""A run's phases that do not grow with its cells."""
MAX_RUNS = 10
"""The newest earlier runs of this machine an estimate reads (older ones: the machine or torch may have changed)."""
COMPARED_SETTINGS = ("budget_s", "target_rel_ci", "min_samples", "warmup_calls", "accuracy")
"""Settings whose difference from the earlier runs' makes the wall-time estimate shakier (said)."""


def this_machine() -> dict:
    """What identifies this machine in a run's ``meta.json``: its host name, CPU model and count."""
    import os

    from attnbench.devices import cpu_model

    return {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count()}


def earlier_runs(results: str | Path, machine: dict | None = None) -> list[tuple[Path, pd.DataFrame, dict]]:
    """``(folder, rows, meta)`` of the newest :data:`MAX_RUNS` run folders under ``results`` that ran on ``machine``
    (default: this one), oldest first; folders that cannot be read are left out."""
    import warnings

    from attnbench.errors import AttnbenchError
    from attnbench.results.store import load_run, read_meta

    machine = this_machine() if machine is None else machine
    root = Path(results)
    mine = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            meta = read_meta(folder) if (folder / "meta.json").is_file() else {}
        except (AttnbenchError, OSError):
            continue
        if meta and all(str(meta.get(k)) == str(v) for k, v in machine.items()):
            mine.append((str(meta.get("timestamp", "")), folder))
    found = []
    for _, folder in sorted(mine)[-MAX_RUNS:]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an older run's filled columns: fine for a fit
                df, meta = load_run(_consolidated(folder))
        except (AttnbenchError, OSError, ValueError):
            continue
        if len(df):
            found.append((folder, df, meta))
    return found


def _consolidated(folder: Path) -> Path:
    """``folder/results.parquet`` when no cell file is newer (a finished run: one file to read, where its ``cells/``
    folder holds a file per cell, ten times slower to read), else ``folder``."""
    table = folder / "results.parquet"
    if not table.is_file():
        return folder
    written = table.stat().st_mtime
    newer = any(f.stat().st_mtime > written for f in (folder / "cells").glob("*.parquet"))
    return folder if newer else table


def units(settings: dict | None) -> int:
    """Times a cell is measured: rounds × processes of the sweep's settings (1 when unknown)."""
    settings = settings or {}
    return max(1, int(settings.get("rounds") or 1) * int(settings.get("processes") or 1))


def cell_seconds(df: pd.DataFrame) -> pd.Series:
    """Each row's own wall seconds: ``duration_s`` (its steps and its share of its group's timed cycles), else the sum
    of its phase columns."""
    present = [c for c in PHASE_COLUMNS if c in df]
    phases = df[present].apply(pd.to_numeric, errors="coerce").fillna(0.0).sum(axis=1) if present else \
        pd.Series(math.nan, index=df.index)
    given = pd.to_numeric(df["duration_s"], errors="coerce") if "duration_s" in df else pd.Series(math.nan, index=df.index)
    return given.where(np.isfinite(given), phases)


def history(runs: list[tuple[Path, pd.DataFrame, dict]]) -> pd.DataFrame:
    """Every earlier row with ``unit_s`` (its wall seconds per round and process: a skipped cell's is about 0), the
    newest run's row of a cell only."""
    frames = []
    for order, (folder, df, meta) in enumerate(runs):
        rows = df.copy()
        rows["unit_s"] = cell_seconds(rows) / units(meta.get("sweep", {}).get("settings"))
        frames.append(rows.assign(_run=order, _folder=str(folder)))
    if not frames:
        return pd.DataFrame()
    rows = pd.concat(frames, ignore_index=True)
    return rows.sort_values("_run").drop_duplicates("cell_id", keep="last").reset_index(drop=True)


@dataclass
class Estimate:
    """A sweep's predicted cells (``cells``: call and wall seconds, and where each came from) and run time."""

    cells: pd.DataFrame
    fixed_s: dict[str, float]
    runs: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        """The predicted wall time of the run: every cell's wall time and the fixed phases."""
        return float(self.cells["cell_s"].sum() + sum(self.fixed_s.values()))


def new_rows(cells) -> pd.DataFrame:
    """The sweep's cells as rows with their FLOPs (:func:`attnbench.runner.budget.cell_flops`; NaN where a kind of
    cell has no count: it then gets no model) and ok status."""
    from attnbench.results.schema import empty_row
    from attnbench.runner.budget import cell_flops

    rows = []
    for cell in cells:
        row = empty_row(cell)
        try:
            flops = float(cell_flops(cell))
        except Exception:  # noqa: BLE001 - a cell kind the FLOP model does not know: measured before, or no estimate
            flops = math.nan
        row.update(status="ok", flops=flops, median_s=1.0)  # median: a placeholder for costmodel.cells
        rows.append(row)
    return pd.DataFrame(rows)


def _model_for(models: dict[tuple, costmodel.Fit], impl: str, device: str, dtype: str, mode: str):
    """The group model whose key covers the cell (a pooled key lists its modes), or None."""
    for key, model in models.items():
        if key[:3] == (impl, device, dtype) and mode in key[3].split(","):
            return model
    return None


def predicted(new: pd.DataFrame, past: pd.DataFrame, target: str) -> tuple[np.ndarray, list[str]]:
    """Each new cell's ``target`` (``median_s`` or ``unit_s``) and where it came from: ``measured`` (the same cell
    earlier), ``model`` (its group's cost model), ``impl median`` / ``all median`` (no model), ``none``."""
    seen = dict(zip(past["cell_id"], pd.to_numeric(past[target], errors="coerce"), strict=True)) if len(past) else {}
    status = dict(zip(past["cell_id"], past["status"].astype(str), strict=True)) if len(past) else {}
    unseen = [c for c in new["cell_id"] if not math.isfinite(seen.get(c, math.nan))]
    models = costmodel.models(past, target) if len(past) and unseen else {}  # fitted only when a cell needs one
    feats = {r["cell_id"]: r for _, r in costmodel.cells(new).iterrows()}
    out, how = np.full(len(new), math.nan), ["none"] * len(new)
    for i, r in enumerate(new.to_dict("records")):
        f = feats.get(r["cell_id"])
        model = None if f is None else _model_for(models, f["impl"], f["device"], f["dtype"], f["mode"])
        if math.isfinite(seen.get(r["cell_id"], math.nan)):
            said = status[r["cell_id"]]
            out[i], how[i] = seen[r["cell_id"]], "measured" if said == "ok" else f"measured ({said})"
        elif model is not None:
            out[i], how[i] = float(model.predict(f["flops"], f["nbytes"])), "model"
        elif target == "unit_s" and len(past):
            same = pd.to_numeric(past.loc[past["impl"].astype(str) == str(r["impl"]), target], errors="coerce").dropna()
            out[i], how[i] = (float(same.median()), "impl median") if len(same) else \
                (float(pd.to_numeric(past[target], errors="coerce").median()), "all median")
    return out, how


def estimate(cells, settings: dict, results: str | Path, report: bool = True) -> Estimate | str:
    """The estimate of a sweep of ``cells`` measured under ``settings`` (the sweep's, as a dict), from the earlier
    runs under ``results`` on this machine; a sentence saying why not when there is none to fit from."""
    runs = earlier_runs(results)
    past = history(runs)
    if not runs or past.empty:
        return (f"no earlier run on this machine under {results} to predict from: run a sweep there first "
                "(attnbench run --out " f"{results}), then --predict estimates from it")
    new = new_rows(cells)
    call_s, call_how = predicted(new, past, "median_s")
    unit_s, cell_how = predicted(new, past, "unit_s")
    n = units(settings)
    table = new[["cell_id", "impl", "device", "dtype", "mode", "batch", "seq_len"]].assign(
        call_s=call_s, call_from=call_how, cell_s=unit_s * n, cell_from=cell_how)
    newest = runs[-1][2]
    phases = newest.get("phases") or {}
    fixed = {k: float(phases.get(k, 0.0)) for k in FIXED_PHASES}
    fixed["bookkeeping"] = float(phases.get("bookkeeping", 0.0)) / max(len(runs[-1][1]), 1) * len(new)
    notes = [] if phases else [f"{runs[-1][0].name} recorded no phases: start-up, workers and bookkeeping not counted"]
    if report:
        fixed["report"] = float(phases.get("report", 0.0))
        if phases and not fixed["report"]:
            notes.append(f"{runs[-1][0].name} wrote no report, so the report's time is not counted")
    before = (newest.get("sweep") or {}).get("settings") or {}
    changed = [k for k in COMPARED_SETTINGS if k in settings and k in before and settings[k] != before[k]]
    if changed:
        notes.append("measurement settings differ from the newest earlier run's ("
                     + ", ".join(f"{k} {before[k]} -> {settings[k]}" for k in changed) + "): cell times are shakier")
    if int(before.get("rounds") or 1) * int(before.get("processes") or 1) != n:
        notes.append("rounds x processes differ from the newest earlier run's: a cell's time is scaled per round, "
                     "though later rounds skip the memory pass")
    notes += cold_note(past, set(table["cell_id"]))
    return Estimate(table, fixed, [str(f) for f, _, _ in runs], notes)


def cold_note(past: pd.DataFrame, cell_ids: set[str]) -> list[str]:
    """A note when compiled cells of the sweep compiled cold in the earlier run they are predicted from: Inductor's
    cache is kept per machine (:mod:`attnbench.runner.compile_cache`), so they may now compile warm, in less time."""
    if "compile_cache" not in past or not len(past):
        return []
    cold = past[past["cell_id"].isin(cell_ids) & (past["compile_cache"].astype(str) == "cold")]
    if cold.empty:
        return []
    seconds = float(pd.to_numeric(cold["compile_s"], errors="coerce").fillna(0.0).sum())
    return [f"{len(cold)} compiled cell(s) compiled cold in the run they are predicted from ({seconds:.0f} s of "
            "compiling); torch.compile's cache is kept per machine, so this run may compile warm, in up to that much "
            "less"]


def lines(est: Estimate, per_cell: bool = True) -> list[str]:
    """The estimate as console lines: each cell (when ``per_cell``), then the run's total and its parts."""
    from attnbench.results.text import fmt_time

    out = []
    if per_cell:
        for r in est.cells.itertuples():
            call = fmt_time(r.call_s) if math.isfinite(r.call_s) else "?"
            cell = fmt_time(r.cell_s) if math.isfinite(r.cell_s) else "?"
            out.append(f"  {r.cell_id}: call ~{call} ({r.call_from}), cell ~{cell} ({r.cell_from})")
    counts = est.cells["cell_from"].value_counts().to_dict()
    unknown = int(est.cells["cell_s"].isna().sum())
    said = ", ".join(f"{n} {k}" for k, n in counts.items())
    fixed = ", ".join(f"{k} {v:.1f} s" for k, v in est.fixed_s.items() if v >= 0.05)
    out.append(f"predicted wall time: ~{est.total_s:.0f} s for {len(est.cells)} cells (cells {est.cells['cell_s'].sum():.1f} s "
               f"[{said}]" + (f"; {fixed}" if fixed else "") + ")")
    if unknown:
        out.append(f"  {unknown} cell(s) have no estimate and count as 0 s")
    out.append(f"  from {len(est.runs)} earlier run(s) on this machine: {', '.join(Path(r).name for r in est.runs[-3:])}"
               + (" ..." if len(est.runs) > 3 else ""))
    out += [f"  note: {n}" for n in est.notes]
    return out
