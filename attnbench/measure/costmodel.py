"""A cost model that says where it is wrong: ``time = a·FLOPs + b·bytes + c``, fitted per implementation (issue 49).

For each implementation, device and dtype (and mode, when every mode has enough cells of its own; else the modes are
pooled and the row says so) the ok cells of a sweep are fitted with three non-negative coefficients: ``a`` seconds
per FLOP (the row's analytic ``flops``), ``b`` seconds per byte (the roofline's ``min_bytes``:
:func:`attnbench.measure.roofline.min_bytes`; 0 for block and model cells, which have none) and ``c`` seconds per call
(the overhead no size removes). The error minimised is the log of predicted over measured time (a cell 2× too slow
weighs as much as one 2× too fast, whatever its size), with a robust loss (:data:`ROBUST_SCALE`), so that a few cells
in another regime do not drag the fit; the start is :func:`scipy.optimize.nnls` on relative errors. Other axes (a
mask, a window, grouped-query heads, a block or model scope) share their implementation's model: their FLOPs and bytes
say what they cost, and a cell where that is not enough is one the model mispredicts.

**Held out.** A model that fits the cells it was fitted on says little. The cells of a group are sorted by size
(FLOPs, then bytes) and dealt to :data:`FOLDS` folds in turn (rank mod k: every fold spans the sizes); each fold is
predicted by the model fitted on the other folds. The group's **held-out error** is the median of ``|predicted -
measured| / measured`` over its cells, and a cell whose measured time is more than :data:`OFF_FACTOR` times off its
held-out prediction (either way) is **mispredicted**: there the implementation changes regime (a kernel switch, a
cache overflow, a fixed cost the others lack) or the cell was timed in a busy moment. A group with fewer than
:data:`MIN_CELLS` ok cells gets no held-out error (the table says so: never a number made from too few cells).

The coefficients of a group are its fit on all its cells. F and bytes grow together in a sweep of one width (both
linearly in tokens), so ``a`` and ``b`` may trade against each other: the predictions are what to read, not the
split between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

GROUP_AXES = ("impl", "device", "dtype", "mode")
"""A model per combination of these (the mode pooled when a mode has fewer than :data:`MIN_CELLS` cells)."""
POOLED_AXES = ("impl", "device", "dtype")
MIN_CELLS = 5
"""The fewest ok cells a group needs for a held-out error: each fold's fit then has at least three cells for its
three coefficients and one left to predict."""
FOLDS = 5
"""Folds of the held-out split (at most one per cell)."""
OFF_FACTOR = 2.0
"""A cell more than this many times off its held-out prediction (slower or faster) is listed as mispredicted."""
ROBUST_SCALE = 0.1
"""The log-error beyond which the fit's loss grows linearly, not quadratically (``soft_l1``; 0.1: about 10%)."""
NEGLIGIBLE = 1e-4
"""A term whose largest contribution to any cell is below this share of the median time is set to 0 (the fit's
optimiser leaves such terms at 1e-19, not 0)."""
TOO_FEW = "not enough cells to hold out"


@dataclass(frozen=True)
class Fit:
    """``seconds = a·flops + b·bytes + c``, each coefficient non-negative, fitted on ``n`` cells."""

    a: float
    b: float
    c: float
    n: int

    def predict(self, flops, nbytes) -> np.ndarray:
        """The predicted seconds of cells of ``flops`` FLOPs and ``nbytes`` bytes (arrays or numbers)."""
        return self.a * np.asarray(flops, dtype=float) + self.b * np.asarray(nbytes, dtype=float) + self.c


def fit(flops, nbytes, seconds) -> Fit:
    """The non-negative ``a·flops + b·bytes + c`` closest to ``seconds`` in log error (robust: :data:`ROBUST_SCALE`);
    a :class:`ValueError` for no cell or a time that is not positive."""
    from scipy.optimize import least_squares, nnls

    x = np.column_stack([np.asarray(flops, dtype=float), np.asarray(nbytes, dtype=float), np.ones(len(seconds))])
    y = np.asarray(seconds, dtype=float)
    if not len(y) or not (np.all(np.isfinite(y)) and np.all(y > 0) and np.all(np.isfinite(x)) and np.all(x >= 0)):
        raise ValueError("a cost model needs at least one cell, positive finite times and non-negative sizes")
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0) / np.median(y)  # each column peaks at the median time: θ of order 1
    xs = x / scale
    start, _ = nnls(xs / y[:, None], np.ones(len(y)))  # relative errors: a first guess of the log fit
    if np.all(start == 0):
        start[2] = 1.0 / np.mean(1.0 / y) * scale[2]

    def residuals(theta):
        return np.log(np.maximum(xs @ theta, 1e-300)) - np.log(y)

    def jacobian(theta):
        return xs / np.maximum(xs @ theta, 1e-300)[:, None]

    if len(y) >= 2:
        start = least_squares(residuals, np.maximum(start, 1e-12), jac=jacobian, bounds=(0.0, np.inf), loss="soft_l1",
                              f_scale=ROBUST_SCALE, x_scale="jac").x
    start = np.where(start < NEGLIGIBLE, 0.0, start)  # a term that adds nothing anywhere: 0, not 1e-19 (said as "–")
    a, b, c = (start / scale).tolist()
    return Fit(a, b, c, len(y))


def cells(df: pd.DataFrame, target: str = "median_s") -> pd.DataFrame:
    """The ok rows a model can use: a finite positive ``target`` and ``flops``; ``nbytes`` their ``min_bytes`` (made
    from the row's shape where the run predates the column; 0 where there is none: blocks, models)."""
    from attnbench.measure.roofline import min_bytes

    if not len(df) or target not in df or "flops" not in df:
        return pd.DataFrame(columns=[*GROUP_AXES, "cell_id", "flops", "nbytes", "seconds"])
    ok = df[df["status"] == "ok"].copy()
    ok["flops"] = pd.to_numeric(ok["flops"], errors="coerce")
    ok["seconds"] = pd.to_numeric(ok[target], errors="coerce")
    ok = ok[np.isfinite(ok["flops"]) & (ok["flops"] >= 0) & np.isfinite(ok["seconds"]) & (ok["seconds"] > 0)]
    given = pd.to_numeric(ok["min_bytes"], errors="coerce") if "min_bytes" in ok else pd.Series(math.nan, index=ok.index)
    missing = ~np.isfinite(given.to_numpy(dtype=float))
    if missing.any():  # a run before the roofline: made from the row's shape
        given = given.copy()
        given[missing] = [min_bytes(r) for r in ok[missing].to_dict("records")]
    ok["nbytes"] = [b if math.isfinite(b) and b > 0 else 0.0 for b in given]
    for axis in GROUP_AXES:
        ok[axis] = ok[axis].astype(str)
    keep = [*GROUP_AXES, *(c for c in ("cell_id", "batch", "seq_len") if c in ok), "flops", "nbytes", "seconds"]
    return ok[keep].reset_index(drop=True)


def folds_of(c: pd.DataFrame, k: int = FOLDS) -> np.ndarray:
    """Each cell's fold: dealt in turn in size order (FLOPs, then bytes, then the cell's key), so every fold spans
    the sizes and the split is the same on every run of the same sweep."""
    order = c.assign(_key=c.get("cell_id", pd.Series(range(len(c)), index=c.index)).astype(str)) \
        .sort_values(["flops", "nbytes", "_key"]).index
    folds = np.empty(len(c), dtype=int)
    folds[c.index.get_indexer(order)] = np.arange(len(c)) % max(1, min(k, len(c)))
    return folds


def held_out(c: pd.DataFrame, k: int = FOLDS) -> np.ndarray:
    """Each cell's prediction by the model fitted on the other folds (:func:`folds_of`)."""
    folds = folds_of(c, k)
    flops, nbytes, seconds = (c[col].to_numpy(dtype=float) for col in ("flops", "nbytes", "seconds"))
    out = np.full(len(c), math.nan)
    for f in np.unique(folds):
        train = folds != f
        out[~train] = fit(flops[train], nbytes[train], seconds[train]).predict(flops[~train], nbytes[~train])
    return out


@dataclass
class Assessment:
    """The cost model of a run: ``summary`` (one row per group: its cells, held-out error, mispredicted cells,
    coefficients, a note), ``cells`` (one row per cell: measured, held-out prediction, ratio, ``off``) and the
    fitted models by group key (the summary's ``key``)."""

    summary: pd.DataFrame
    cells: pd.DataFrame
    models: dict[tuple, Fit]

    @property
    def mispredicted(self) -> pd.DataFrame:
        """The cells more than :data:`OFF_FACTOR` off their held-out prediction, worst first."""
        off = self.cells[self.cells["off"]]
        return off.assign(_w=np.abs(np.log(off["ratio"]))).sort_values("_w", ascending=False).drop(columns="_w")


def groups(c: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame, bool]]:
    """``(key, cells, pooled)`` per model: per implementation, device and dtype, one per mode when every mode has
    :data:`MIN_CELLS` cells, else one for all modes (``pooled``; the key's mode is then every mode joined by ``,``)."""
    out = []
    for key, sub in c.groupby(list(POOLED_AXES), sort=True):
        per_mode = list(sub.groupby("mode", sort=True))
        if len(per_mode) > 1 and min(len(m) for _, m in per_mode) < MIN_CELLS:
            out.append(((*key, ",".join(name for name, _ in per_mode)), sub.reset_index(drop=True), True))
        else:
            out += [((*key, name), m.reset_index(drop=True), False) for name, m in per_mode]
    return out


def models(df: pd.DataFrame, target: str = "median_s") -> dict[tuple, Fit]:
    """Each group's model (:func:`groups`) fitted on all its ok cells against ``target``, nothing held out: what
    predicts cells not run yet (``attnbench run --predict``)."""
    return {key: fit(sub["flops"], sub["nbytes"], sub["seconds"]) for key, sub, _ in groups(cells(df, target))}


def assess(df: pd.DataFrame, target: str = "median_s", k: int = FOLDS) -> Assessment:
    """The cost model of ``df``'s ok cells (a run's rows) against ``target`` (``median_s``: one call; or a cell's wall
    seconds): fitted per group (:func:`groups`), every cell predicted held out (:func:`held_out`)."""
    summary, per_cell, models = [], [], {}
    for key, sub, pooled in groups(cells(df, target)):
        models[key] = fit(sub["flops"], sub["nbytes"], sub["seconds"])
        enough = len(sub) >= MIN_CELLS
        predicted = held_out(sub, k) if enough else np.full(len(sub), math.nan)
        ratio = sub["seconds"].to_numpy() / predicted
        off = np.isfinite(ratio) & ((ratio > OFF_FACTOR) | (ratio < 1 / OFF_FACTOR))
        per_cell.append(pd.DataFrame({**dict(zip(GROUP_AXES, key, strict=True)), "cell_id": sub.get("cell_id", ""),
                                      "seq_len": sub.get("seq_len", math.nan), "batch": sub.get("batch", math.nan),
                                      "cell_mode": sub["mode"], "flops": sub["flops"], "nbytes": sub["nbytes"],
                                      "measured_s": sub["seconds"], "predicted_s": predicted, "ratio": ratio, "off": off}))
        error = np.median(np.abs(predicted - sub["seconds"].to_numpy()) / sub["seconds"].to_numpy()) if enough else math.nan
        note = "; ".join(filter(None, [
            f"modes pooled ({key[3]}): a mode has fewer than {MIN_CELLS} cells" if pooled else "",
            too_few_text(len(sub)) if not enough else ""]))
        m = models[key]
        summary.append({**dict(zip(GROUP_AXES, key, strict=True)), "key": key, "cells": len(sub),
                        "heldout_median_rel_error": error, "mispredicted": int(off.sum()) if enough else 0,
                        "worst_ratio": _worst(ratio), "a_s_per_flop": m.a, "b_s_per_byte": m.b, "c_s": m.c, "note": note})
    frame = pd.concat(per_cell, ignore_index=True) if per_cell else pd.DataFrame(
        columns=[*GROUP_AXES, "cell_id", "measured_s", "predicted_s", "ratio", "off"])
    frame["off"] = frame["off"].astype(bool)
    return Assessment(pd.DataFrame(summary), frame, models)


def _worst(ratio: np.ndarray) -> float:
    """The ratio furthest from 1 (either way) among the finite ones; NaN when none is."""
    finite = ratio[np.isfinite(ratio) & (ratio > 0)]
    return float(finite[np.argmax(np.abs(np.log(finite)))]) if len(finite) else math.nan


def too_few_text(n: int) -> str:
    """The honest sentence for a group too small to hold out."""
    return f"{TOO_FEW}: {n} ok cell{'s' if n != 1 else ''}, a held-out error needs at least {MIN_CELLS}"
