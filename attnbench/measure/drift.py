"""Between-run drift: the part of a cell's uncertainty that one run cannot see, calibrated per machine.

A run's own CI (:func:`attnbench.measure.stats.summarize_groups`) covers the variance between the samples,
rounds and processes of that run. A second run on the same machine minutes later still lands outside it
more often than 5% of the time: the machine's slow drift (other tenants, frequency, memory placement)
moves every round of a run together. That term is measured, not guessed: ``python -m
attnbench.tools.reproducibility --calibrate`` runs one sweep K times in fresh processes and, for every
cell and ordered pair of runs (i, j), finds the smallest term ``d_ij`` with which run i's CI, widened as
below, would contain run j's median; the calibrated term is the 95th percentile of the ``d_ij`` (the
``confidence`` quantile). So, on the calibration runs, the reported CI covers an independent rerun's median
in 95% of cases: the interval is calibrated against reruns, the question a user of two runs asks.

Every CI of a run is widened in quadrature on the log scale, ``h' = sqrt(h^2 + (z * rel)^2)`` with ``h``
each side's log half-width and ``z`` the normal quantile of the confidence; ``attnbench compare`` adds the
same term to the ratio of two runs.

A run noisier than the calibration runs needs more: the spread between the round medians of its cells
(:func:`round_spread`, pooled over every cell with two or more rounds or processes, so dozens of cells
give a stable figure where one cell's three rounds would not) is compared with the calibration runs'
(``round_sd``); when it is larger, ``rel`` is scaled up by the ratio at the end of the run (never down), and
the source says so. A run with one round per cell has no such spread and keeps the calibrated term.

Where ``rel`` comes from, in order: ``--drift`` (a number, 0 turns the term off); this machine's
calibration file (:func:`calibration_path`, one entry per host, CPU, device type and allocator);
for CPU cells, :data:`DEFAULT_CPU`, measured on a 2-vCPU cloud VM like CI's; for other devices nothing
(0, and the run says the CIs are uncalibrated). The value used and its source are in ``meta.json``
(``drift``) and on every row (``drift_rel``, and ``ci_within_rel``: the CI before widening).
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from attnbench.devices import cpu_model
from attnbench.errors import SweepError
from attnbench.measure.machine_file import load_entries, save_entry
from attnbench.measure.stats import rewiden, split_groups, widen, z_value  # noqa: F401  (widen: drift.widen)

DEFAULT_CPU = 0.022
"""``rel`` for CPU cells on a machine without a calibration, measured on 2026-11-30 on a shared 2-vCPU cloud
VM (the CI machine's class): 12 runs of ``python -m attnbench.tools.reproducibility`` (weight_split,
fused_qkv, einsum, sdpa x T 256, 512, inference, ``--rounds 3``, pinned allocator, 1 bound thread) in two
sets 20 minutes apart, calibrated over all of their pairs (2.85% within the first set, 1.65% within the
second). A quieter machine needs less, a busier one more: calibrate yours."""

DEFAULT_CPU_ROUND_SD = 0.034
"""The :func:`round_spread` of the runs :data:`DEFAULT_CPU` was calibrated on (their mean)."""

SLOWER = 0.10
"""A run whose peak GEMM is more than this fraction below the calibration runs' gets a warning."""

ENV_FILE = "ATTNBENCH_DRIFT_FILE"
"""Environment variable naming the calibration file (default: ``~/.cache/attnbench/drift.json``)."""


@dataclass(frozen=True)
class Drift:
    """The between-run term used for a device type: ``rel`` (log-scale standard deviation) and where it came from."""

    rel: float
    source: str
    round_sd: float | None = None  # round_spread() of the calibration runs: a noisier run scales rel up
    peak_gflops: float | None = None  # the calibration runs' peak GEMM (float32): a slower machine is said so

    def as_meta(self) -> dict:
        return {"rel": self.rel, "source": self.source, "round_sd": self.round_sd, "peak_gflops": self.peak_gflops}

    def speed_warning(self, peak: float | None) -> str | None:
        """A warning when this run's peak GEMM is more than :data:`SLOWER` below the calibration runs': the
        whole machine is slower (another tenant of the host, say), which no within-run spread reveals when the
        load is steady; None otherwise or without a reference."""
        if not (self.peak_gflops and peak and peak < (1 - SLOWER) * self.peak_gflops):
            return None
        return (f"this machine ran {100 * (1 - peak / self.peak_gflops):.0f}% slower than when calibrated (peak GEMM "
                f"{peak:.0f} against {self.peak_gflops:.0f} GFLOP/s): other load on the host; every timing is inflated, "
                "and comparisons with runs made at another time are unreliable")

    def for_run(self, spread: float | None) -> Drift:
        """This term for a run whose :func:`round_spread` is ``spread``: scaled up by ``spread / round_sd``
        when the run is noisier than the calibration runs, else unchanged."""
        if not (self.rel and self.round_sd and spread and spread > self.round_sd):
            return self
        k = spread / self.round_sd
        return Drift(self.rel * k, f"{self.source}; scaled x{k:.2f}: this run's round medians spread "
                                   f"{100 * spread:.1f}% (1 SD) against {100 * self.round_sd:.1f}% in the calibration "
                                   f"runs", self.round_sd, self.peak_gflops)


def calibration_path() -> Path:
    """The calibration file: ``$ATTNBENCH_DRIFT_FILE``, else ``$XDG_CACHE_HOME/attnbench/drift.json``
    (``~/.cache`` when unset). Kept outside any repository: it describes a machine, not a project."""
    if os.environ.get(ENV_FILE):
        return Path(os.environ[ENV_FILE])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "attnbench" / "drift.json"


def machine_key(device_type: str, allocator: str) -> str:
    """The calibration entry a run on this machine uses: host, CPU model and count, device type, allocator."""
    return f"{socket.gethostname()}|{cpu_model()}|{os.cpu_count()}|{device_type}|{allocator}"


def load_calibrations(path: Path | None = None) -> dict[str, dict]:
    """Every entry of the calibration file ({} when there is none). A corrupt file is an error naming it."""
    return load_entries(path or calibration_path(), SweepError, "drift calibration",
                        "delete it or recalibrate with `python -m attnbench.tools.reproducibility --calibrate`")


def save_calibration(key: str, entry: dict, path: Path | None = None) -> Path:
    """Write (or replace) one entry of the calibration file, atomically; the file's path."""
    path = path or calibration_path()
    return save_entry(path, load_calibrations(path), key, entry)


def check_setting(value) -> None:
    """``--drift`` must be a finite number >= 0 (None: calibrated or default)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SweepError(f"--drift must be a fraction >= 0 (0.02 means 2%; 0 turns the between-run term off), "
                         f"got {value!r}")
    if value >= 1:
        raise SweepError(f"--drift {value} is a fraction: 0.02 means 2% (got a value >= 1)")


def term_for(setting: float | None, device_type: str, allocator: str) -> Drift:
    """The between-run term for cells on ``device_type`` (see the module docstring for the order)."""
    check_setting(setting)
    if setting is not None:
        return Drift(float(setting), "--drift")
    path = calibration_path()
    entry = load_calibrations(path).get(machine_key(device_type, allocator))
    if entry and isinstance(entry.get("rel"), int | float):
        def positive(key: str) -> float | None:
            value = entry.get(key)
            return float(value) if isinstance(value, int | float) and value > 0 else None

        return Drift(float(entry["rel"]), f"calibrated on this machine {entry.get('date', '?')} from "
                                          f"{entry.get('runs', '?')} runs ({path})", positive("round_sd"),
                     positive("peak_gflops"))
    if device_type == "cpu":
        return Drift(DEFAULT_CPU, "default for CPU (measured on a shared 2-vCPU VM); calibrate this machine with "
                                  "`python -m attnbench.tools.reproducibility --calibrate`", DEFAULT_CPU_ROUND_SD)
    return Drift(0.0, f"uncalibrated on {device_type}: CIs cover this run's variance only; calibrate with "
                      f"`python -m attnbench.tools.reproducibility --calibrate --device {device_type}`")


def round_spread(rows: pd.DataFrame) -> float | None:
    """How far a run's round (and process) medians spread: the root of the mean, over its ``ok`` cells with
    two or more sample groups, of the variance of their groups' log-medians. None without such cells."""
    variances = []
    for samples, sizes, status in zip(rows["samples_s"], rows["sample_groups"], rows["status"], strict=True):
        if status != "ok":
            continue
        medians = np.array([np.median(g) for g in split_groups(samples, sizes) if len(g)])
        if len(medians) >= 2 and (medians > 0).all():
            variances.append(float(np.var(np.log(medians), ddof=1)))
    return float(math.sqrt(np.mean(variances))) if variances else None


def _within_half_width(rows: pd.DataFrame) -> np.ndarray:
    """Each row's log half-width of its CI before any between-run term (``ci_within_rel``; ``ci_rel``
    for runs measured without one)."""
    rel = rows["ci_within_rel"] if "ci_within_rel" in rows else pd.Series(np.nan, index=rows.index)
    rel = rel.where(rel.notna(), rows["ci_rel"]).astype(float).fillna(0.0)
    return np.log1p(rel.to_numpy())


def covers(rows: pd.DataFrame, other_medians: np.ndarray, rel: float, confidence: float = 0.95) -> np.ndarray:
    """Whether each row's within-run CI, widened by ``rel``, contains the matching median of another run."""
    d = np.abs(np.log(np.asarray(other_medians, dtype=float) / rows["median_s"].to_numpy(dtype=float)))
    h = _within_half_width(rows)
    return d <= np.sqrt(h ** 2 + (z_value(confidence) * rel) ** 2)


def estimate(frames: list[pd.DataFrame], confidence: float = 0.95) -> dict:
    """The between-run term from several runs of one sweep (see the module docstring), over the ``ok``
    cells measured in at least two runs: ``{"rel", "cells", "pairs", "covered_within", "round_sd"}``
    (``covered_within``: the share of ordered pairs the within-run CIs covered on their own; ``round_sd``:
    the runs' mean :func:`round_spread`, None with one round per cell)."""
    ok = pd.concat([f.assign(_run=i) for i, f in enumerate(frames)])
    ok = ok[(ok.status == "ok") & (ok.median_s > 0)]
    z = z_value(confidence)
    needed, cells = [], 0
    for _, g in ok.groupby("cell_id", sort=False):
        if len(g) < 2:
            continue
        cells += 1
        y, h = np.log(g.median_s.to_numpy(dtype=float)), _within_half_width(g)
        i, j = np.nonzero(~np.eye(len(g), dtype=bool))  # ordered pairs: run i's CI, run j's median
        needed.extend(np.sqrt(np.maximum(0.0, (y[j] - y[i]) ** 2 - h[i] ** 2)) / z)
    if not needed:
        raise SweepError("the drift estimate needs ok cells measured in at least two runs")
    needed = np.asarray(needed)
    spreads = [s for s in (round_spread(f) for f in frames if "sample_groups" in f) if s is not None]
    return {"rel": float(np.quantile(needed, confidence)), "cells": cells, "pairs": len(needed),
            "covered_within": float(np.mean(needed == 0)),
            "round_sd": float(np.mean(spreads)) if spreads else None}


def calibration_entry(result: dict, runs: int, settings: dict, peak_gflops: float | None = None) -> dict:
    """What the calibration file keeps for one machine: the estimate, the runs' median peak GEMM (float32),
    when, and what was run."""
    return {**result, "peak_gflops": peak_gflops, "runs": runs, "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
            "settings": settings}
