"""``attnbench compare A B``: two runs cell by cell, with a confidence interval and a significance test per cell.

Cells are matched on :data:`attnbench.results.schema.AXES`. For a cell timed successfully in both runs, the
effect is the ratio of medians ``B / A`` (> 1: B is slower), with a hierarchical bootstrap confidence
interval and p-value: each run's raw per-call ``samples_s`` are resampled by their groups (rounds,
processes: ``sample_groups``) first and within them second, the model of ``attnbench run``'s own CI,
so drift between rounds and processes counts as uncertainty rather than as evidence; and, as in that CI,
the between-run term (``drift_rel``, :mod:`attnbench.measure.drift`) that two runs differ by even when
nothing changed is added on the log scale (the larger of the two runs' values). Seeded: the same
inputs give the same answer. Between two runs on a shared machine every cell moves together as well (issue 39: two
identical runs 11 s apart read 0.837x): when four or more cells are compared and more than half of them moved alike,
that **common shift** (:func:`common_shift`) is the null each cell is tested against, its standard error joins the
between-run term, and a note says how far the runs moved (``run_shift=False``, ``--no-run-shift``: tested against 1).
A cell is a **significant slowdown** when
``p < alpha`` and the ratio over the shift exceeds ``1 + threshold`` and the interval's lower bound over it exceeds 1;
``attnbench compare`` exits 1 when any cell is one. Cells present in only one run, cells whose
status differs, and axes whose value sets differ are reported, never silently dropped. A cell flagged
``unstable`` (two modes) in either run says so in ``change`` when its difference is significant.

A cell timed under other load (``contended``) in either run is judged against what that load can explain (issue 45,
:func:`judge_contended`): run B's recorded load bounds how much it can have slowed B's median
(:func:`attnbench.measure.contention.explainable_slowdown`, ``(1 + u) / (1 - u)``; 1 when B was not contended), so a
significant slowdown beyond the threshold whose CI's lower bound over the shift exceeds that bound is a **regression**
whatever the load; one the load can explain is :data:`INCONCLUSIVE` (``attnbench compare`` exits
:data:`EXIT_INCONCLUSIVE`, 3: rerun, then fail); any other significant reading of a contended cell (faster, or
slower within the threshold) is no verdict (:data:`NO_VERDICT`) and fails nothing, as it would not on a quiet machine.

With ``speedups=True`` (``attnbench compare A B --speedups``) the effect is instead the ratio of the two runs'
**paired speed-ups** against their comparison group's baseline, ``speedup_B / speedup_A`` (< 1: the
implementation lost ground against the baseline in B). Each run's speed-up comes from bursts of the group's
members timed in alternation, so a drift of the machine between the runs, which moves every time alike,
cancels in it. Its CI combines the two runs' paired 95% CIs on the log scale (their standard errors added in
quadrature); the p-value is the normal test of that log-ratio. The decision rule is the same: a cell is a
**significant slowdown** when ``p < alpha``, the ratio is below ``1 / (1 + threshold)`` and the CI's upper
bound is below 1. Baseline rows (speed-up 1 by definition) are not compared; a row without a paired speed-up
in either run is ``untested`` and says why.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from attnbench.errors import ResultsError
from attnbench.measure import contention
from attnbench.measure.stats import bootstrap_medians, group_median, split_groups
from attnbench.results.schema import AXES, INT_AXES, fill_added_columns
from attnbench.results.store import load_run, the_run
from attnbench.results.text import fmt_contention

ENV_COMPARE = ("git_commit", "attnbench_version", "torch_version", "python_version", "cuda_version", "cuda_driver",
               "platform", "hostname", "cpu_model", "cpu_count", "torch_threads", "gpus")
"""Metadata keys whose difference between two runs is worth a line in the comparison."""

_NUMERIC_AXES = (*INT_AXES, "num_kv_heads", "window")  # matched as integers; window NaN (full attention) -> -1


@dataclass
class CompareResult:
    """The comparison of run B against run A.

    ``cells``: one row per cell timed ok in both runs, sorted by effect (largest slowdown first), with
    ``median_a``, ``median_b``, ``ratio`` (B/A), ``ci_low``/``ci_high`` (bootstrap CI of the ratio),
    ``p_value`` (bootstrap, two-sided), ``n_a``/``n_b``, ``change`` (words), the booleans ``regression``,
    ``improvement`` and ``unstable`` (either run flagged the cell; its modes are in ``note``), ``contended``
    (``A: contended (others 47%, steal 0%)`` when a run timed the cell under other load, else "").
    ``only_in_a``/``only_in_b``: axis dicts of unmatched cells. ``status_changed``:
    cells present in both runs but not ok in at least one. ``axis_mismatch``: axis -> values only in A /
    only in B. ``env_diff``: ``(key, A, B)`` for metadata that differs.
    """

    cells: pd.DataFrame
    only_in_a: list[dict]
    only_in_b: list[dict]
    status_changed: pd.DataFrame
    axis_mismatch: dict[str, dict[str, list]]
    label_a: str
    label_b: str
    threshold: float
    alpha: float
    resamples: int
    meta_a: dict = field(default_factory=dict)
    meta_b: dict = field(default_factory=dict)
    env_diff: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    frames: tuple[pd.DataFrame, pd.DataFrame] | None = field(default=None, repr=False)
    kind: str = "times"  # "times": ratio of medians B/A; "speedups": ratio of paired speed-ups B/A

    @property
    def regressions(self) -> pd.DataFrame:
        """Cells that are significantly slower in B by more than the threshold."""
        return self.cells[self.cells["regression"]]

    @property
    def improvements(self) -> pd.DataFrame:
        """Cells that are significantly faster in B by more than the threshold."""
        return self.cells[self.cells["improvement"]]

    @property
    def has_regression(self) -> bool:
        """True when at least one cell is a significant slowdown beyond the threshold."""
        return bool(len(self.regressions))

    @property
    def inconclusive(self) -> pd.DataFrame:
        """Cells read significantly slower beyond the threshold under other load that could explain it
        (:data:`INCONCLUSIVE`): ``attnbench compare`` exits :data:`EXIT_INCONCLUSIVE` when there is one and no
        regression."""
        return self.cells[self.cells["inconclusive"]] if "inconclusive" in self.cells else self.cells.iloc[0:0]

    def summary(self) -> str:
        """One paragraph in words."""
        n = len(self.cells)
        if self.kind == "speedups":
            parts = [f"{n} speed-up{'s' if n != 1 else ''} compared: {len(self.regressions)} significantly lower "
                     f"in B (the implementation lost more than {self.threshold:.0%} against its baseline), "
                     f"{len(self.improvements)} significantly higher, "
                     f"{n - len(self.regressions) - len(self.improvements)} without a significant change beyond the "
                     "threshold."]
        else:
            parts = [f"{n} cell{'s' if n != 1 else ''} timed in both runs: {len(self.regressions)} significantly "
                     f"slower in B by more than {self.threshold:.0%}, {len(self.improvements)} significantly faster, "
                     f"{n - len(self.regressions) - len(self.improvements)} without a significant change beyond the "
                     "threshold."]
        inconclusive = len(self.inconclusive)
        if inconclusive:
            parts.append(f"{inconclusive} cell(s) read slower beyond the threshold while other load took the CPUs in "
                         "B, by no more than that load can explain (contended): inconclusive; rerun them on a quiet "
                         "machine.")
        unjudged = int(self.cells["change"].astype(str).str.endswith(NO_VERDICT).sum()) if len(self.cells) else 0
        if unjudged:
            parts.append(f"{unjudged} other cell(s) differed while other load took the CPUs in a run (contended): "
                         "no verdict, not counted.")
        if self.only_in_a or self.only_in_b:
            parts.append(f"{len(self.only_in_a)} cell(s) only in A and {len(self.only_in_b)} only in B "
                         "were not compared.")
        if len(self.status_changed):
            parts.append(f"{len(self.status_changed)} cell(s) failed or were skipped in at least one run.")
        if self.axis_mismatch:
            parts.append("The runs swept different values of " + ", ".join(self.axis_mismatch) + ".")
        return " ".join(parts)


# ---------------------------------------------------------------- statistics


def _ratio_draws(a, b, resamples: int, seed: int, drift: float = 0.0) -> np.ndarray:
    """Bootstrap draws of ``median(b) / median(a)``, each run resampled hierarchically on its own, times
    ``exp(drift * Z)``: the between-run term (:mod:`attnbench.measure.drift`) that no resample of one run sees."""
    rng = np.random.default_rng(seed)
    draws = bootstrap_medians(_groups_of(b), resamples, rng) / bootstrap_medians(_groups_of(a), resamples, rng)
    if drift:
        draws = draws * np.exp(drift * rng.standard_normal(len(draws)))
    return draws


def _row_drift(ra: dict, rb: dict) -> float:
    """The between-run term of a pair of rows: the larger of the two runs' ``drift_rel`` (0 for older runs)."""
    values = [float(r.get("drift_rel")) for r in (ra, rb) if r.get("drift_rel") is not None]
    values = [v for v in values if np.isfinite(v)]
    return max(values, default=0.0)


def _groups_of(x) -> list[np.ndarray]:
    """A run's samples as groups: a flat array is one group; a list of arrays is already grouped."""
    if isinstance(x, list | tuple) and x and np.ndim(x[0]) == 1:
        return [np.asarray(g, dtype=float) for g in x]
    return [np.asarray(x, dtype=float)]


def bootstrap_ratio(a, b, resamples: int = 2000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap ``(1 - alpha)`` CI of ``median(b) / median(a)``.

    ``a`` and ``b`` are raw samples, or lists of sample groups (rounds, processes): groups are resampled
    first, then samples within them (:func:`attnbench.measure.stats.bootstrap_medians`).
    """
    lo, hi = np.quantile(_ratio_draws(a, b, resamples, seed), [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def ratio_p_value(draws: np.ndarray) -> float:
    """Two-sided bootstrap p-value of "the ratio is 1" from the draws of the ratio (resolution 1 / draws)."""
    below, above = int((draws <= 1).sum()), int((draws >= 1).sum())
    return float(min(1.0, (2 * min(below, above) + 1) / (len(draws) + 1)))


SPEEDUP_COLUMNS = ("baseline", "speedup_a", "speedup_a_low", "speedup_a_high", "speedup_b", "speedup_b_low",
                   "speedup_b_high")


def _text(value) -> str:
    """A string cell as text: "" for None, NaN and pandas' NA."""
    return "" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


def _finite(*values) -> bool:
    try:
        return all(v is not None and np.isfinite(float(v)) for v in values)
    except (TypeError, ValueError):
        return False


def speedup_ratio(a: tuple[float, float, float], b: tuple[float, float, float], alpha: float = 0.05,
                  level: float = 0.95) -> tuple[float, float, float, float]:
    """``(ratio, ci_low, ci_high, p)`` of ``speedup_b / speedup_a`` from each run's ``(speedup, ci_low, ci_high)``.

    Each paired CI (at ``level``) gives a standard error of the log speed-up (its log half-width over the
    normal quantile); the two runs are independent, so the log-ratio's standard error is their root sum of
    squares. The CI is at ``1 - alpha``; ``p`` is the two-sided normal test of "the ratio is 1".
    """
    z_level = math.sqrt(2) * _erfinv(level)
    se = [(math.log(hi) - math.log(lo)) / (2 * z_level) for _, lo, hi in (a, b)]
    d = math.log(b[0]) - math.log(a[0])
    se_d = math.hypot(*se)
    z = math.sqrt(2) * _erfinv(1 - alpha)
    if se_d == 0:
        return math.exp(d), math.exp(d), math.exp(d), 1.0 if d == 0 else 0.0
    p = math.erfc(abs(d) / se_d / math.sqrt(2))
    return math.exp(d), math.exp(d - z * se_d), math.exp(d + z * se_d), float(p)


def _erfinv(x: float) -> float:
    from scipy.special import erfinv

    return float(erfinv(x))


def _speedup_cell(ra: dict, rb: dict, row: dict, threshold: float, alpha: float) -> dict | None:
    """``row`` completed with the comparison of the two rows' paired speed-ups; None for a baseline row."""
    base_a, base_b = _text(ra.get("baseline")), _text(rb.get("baseline"))
    if ra["impl"] in (base_a, base_b) or rb["impl"] in (base_a, base_b):
        return None  # the baseline's speed-up is 1 by definition
    sa = tuple(float(ra.get(k)) if _finite(ra.get(k)) else float("nan") for k in ("speedup", "speedup_ci_low",
                                                                                     "speedup_ci_high"))
    sb = tuple(float(rb.get(k)) if _finite(rb.get(k)) else float("nan") for k in ("speedup", "speedup_ci_low",
                                                                                     "speedup_ci_high"))
    row.update(baseline=base_a if base_a == base_b else f"{base_a or '–'} / {base_b or '–'}",
               speedup_a=sa[0], speedup_a_low=sa[1], speedup_a_high=sa[2],
               speedup_b=sb[0], speedup_b_low=sb[1], speedup_b_high=sb[2])
    why = []
    if base_a != base_b:
        why.append(f"the runs' baselines differ (A {base_a or 'none'}, B {base_b or 'none'})")
    for side, r, sp in (("A", ra, sa), ("B", rb, sb)):
        if not _finite(*sp) or sp[0] <= 0 or sp[1] <= 0:
            reason = next((n for n in _text(r.get("notes")).split("; ") if "speed-up" in n or "paired" in n), "")
            why.append(f"no paired speed-up with a CI in {side}" + (f" ({reason})" if reason else
                                                                   " (a run before paired speed-ups?)"))
    if why:
        if _finite(sa[0], sb[0]) and sa[0] > 0 and base_a == base_b:
            row["ratio"] = sb[0] / sa[0]
        row["change"] = "untested"
        row["note"] = "; ".join(why)
        return row
    ratio, lo, hi, p = speedup_ratio(sa, sb, alpha)
    row.update(ratio=ratio, ci_low=lo, ci_high=hi, p_value=p)
    significant = p < alpha
    # lower speed-up in B: the implementation lost ground against its baseline (a slowdown)
    row["regression"] = bool(significant and ratio < 1 / (1 + threshold) and hi < 1)
    row["improvement"] = bool(significant and ratio > 1 + threshold and lo > 1)
    row["change"] = ("slower" if row["regression"] else "faster" if row["improvement"] else
                     "slower, within threshold" if significant and hi < 1 else
                     "faster, within threshold" if significant and lo > 1 else "no significant change")
    if row["unstable"] and significant:
        row["change"] += " (unstable cell: the difference may be a change of mode)"
    return row


def _unstable_note(row: dict) -> str:
    """The row's ``unstable: ... modes ...`` note, or "" for a stable cell."""
    if str(row.get("stability")) != "unstable":
        return ""
    return next((n for n in str(row.get("notes") or "").split("; ") if n.startswith("unstable")), "unstable")


# ---------------------------------------------------------------- matching


def _load(run) -> tuple[pd.DataFrame, dict, str]:
    if isinstance(run, pd.DataFrame):
        return run.copy(), dict(run.attrs.get("meta", {})), str(run.attrs.get("run_id", "") or "")
    if isinstance(run, tuple) and len(run) == 2:
        return run[0].copy(), dict(run[1]), str(run[1].get("run_id", ""))
    path = the_run(run)  # a folder holding one run (--out r1 writes r1/<run-id>/) is that run
    df, meta = load_run(path)
    label = str(meta.get("run_id") or (path.name if path.is_dir() else path.parent.name))
    return df, meta, label


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    df = fill_added_columns(df.copy())
    missing = [a for a in AXES if a not in df.columns]
    if missing:
        raise ResultsError(f"results lack the axis column(s) {missing}; not an attnbench results table")
    for a in AXES:
        if a in _NUMERIC_AXES:
            df[a] = pd.to_numeric(df[a], errors="coerce").fillna(-1).astype("int64")
        else:
            df[a] = df[a].astype(object).where(df[a].notna(), "").astype(str)
    df["status"] = df["status"].astype(object).where(df["status"].notna(), "").astype(str)
    if "samples_s" not in df:
        df["samples_s"] = [[] for _ in range(len(df))]
    df["samples_s"] = df["samples_s"].apply(lambda v: [] if v is None or isinstance(v, str) else [float(x) for x in v])
    df["median_s"] = pd.to_numeric(df["median_s"], errors="coerce")
    df["_key"] = list(zip(*(df[a] for a in AXES), strict=True)) if len(df) else []
    return df


def _axes_dict(key: tuple) -> dict:
    return {a: (int(v) if a in _NUMERIC_AXES else v) for a, v in zip(AXES, key, strict=True)}


def _env(value) -> str:
    if value is None or value == [] or value == "":
        return "–"
    return ", ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


@dataclass(frozen=True)
class _Rule:
    """The decision rule's knobs, as :func:`compare_runs` was given them."""

    threshold: float
    alpha: float
    resamples: int
    seed: int
    speedups: bool
    shift: float = 0.0  # log of the run's common shift (RunShift.log_ratio), the null every cell is tested against
    shift_se: float = 0.0  # its standard error, added in quadrature to the between-run term


CELL_COLUMNS = [*AXES, "median_a", "median_b", "ratio", "ci_low", "ci_high", "p_value", "n_a", "n_b", "change",
                "regression", "improvement", "inconclusive", "unstable", "contended", "load_bound", "note"]
"""The columns of :attr:`CompareResult.cells` (plus :data:`SPEEDUP_COLUMNS` with ``speedups=True``)."""


def compare_runs(a, b, threshold: float = 0.10, alpha: float = 0.05, resamples: int = 2000,
                 seed: int = 0, speedups: bool = False, run_shift: bool = True) -> CompareResult:
    """Compare run ``b`` against run ``a`` (each a run folder, a ``results.parquet``, or a DataFrame).

    See :class:`CompareResult` for what comes back and the module docstring for the decision rule;
    ``speedups``: compare the paired speed-ups instead of the medians (``ratio`` is then
    ``speedup_B / speedup_A`` and the cells carry :data:`SPEEDUP_COLUMNS`); ``run_shift``: test each cell's ratio
    against the shift every cell of the two runs shares (:func:`common_shift`; False: against 1).
    """
    if threshold < 0:
        raise ResultsError(f"--threshold must be >= 0 (a fraction: 0.10 means 10%), got {threshold}")
    if not 0 < alpha < 1:
        raise ResultsError(f"--alpha must be between 0 and 1, got {alpha}")
    rule = _Rule(threshold, alpha, resamples, seed, speedups)
    (dfa, meta_a, label_a), (dfb, meta_b, label_b) = _load_pair(a, b)
    notes = [f"run {name} has {dup} duplicated cell(s); the last row of each is used."
             for name, df in (("A", dfa), ("B", dfb)) if (dup := int(df["_key"].duplicated().sum()))]
    ia = {r["_key"]: r for r in dfa.to_dict("records")}  # the last row of a duplicated cell wins
    ib = {r["_key"]: r for r in dfb.to_dict("records")}
    common = [k for k in ia if k in ib]
    if run_shift and not speedups:
        shift = common_shift([(ia[k], ib[k]) for k in common], threshold)
        if shift is not None:
            rule = _Rule(threshold, alpha, resamples, seed, speedups, shift.log_ratio, shift.se)
            notes.append(shift.describe())
    rows, changed = [], []
    for key in common:
        ra, rb = ia[key], ib[key]
        if ra["status"] != "ok" or rb["status"] != "ok":
            changed.append({**_axes_dict(key), "status_a": ra["status"], "status_b": rb["status"],
                            "error_a": str(ra.get("error") or ""), "error_b": str(rb.get("error") or "")})
            continue
        row = _compare_cell(key, ra, rb, rule)
        if row is not None:
            rows.append(row)
    cells = _cells_frame(rows, rule, bool(common), notes)
    if not len(dfa) or not len(dfb):
        notes.append(f"run {'A' if not len(dfa) else 'B'} has no cells at all.")
    return CompareResult(
        cells=cells,
        only_in_a=[_axes_dict(k) for k in ia if k not in ib],
        only_in_b=[_axes_dict(k) for k in ib if k not in ia],
        status_changed=pd.DataFrame(changed, columns=[*AXES, "status_a", "status_b", "error_a", "error_b"]),
        axis_mismatch=_axis_mismatch(dfa, dfb), label_a=label_a, label_b=label_b, threshold=threshold, alpha=alpha,
        resamples=resamples, meta_a=meta_a, meta_b=meta_b,
        env_diff=[(k, _env(meta_a.get(k)), _env(meta_b.get(k))) for k in ENV_COMPARE
                  if _env(meta_a.get(k)) != _env(meta_b.get(k))], notes=notes,
        frames=(dfa.drop(columns="_key"), dfb.drop(columns="_key")), kind="speedups" if speedups else "times",
    )


def _load_pair(a, b) -> tuple[tuple[pd.DataFrame, dict, str], tuple[pd.DataFrame, dict, str]]:
    """Both runs loaded and normalised (a ``_key`` column), with labels that tell them apart."""
    dfa, meta_a, label_a = _load(a)
    dfb, meta_b, label_b = _load(b)
    label_a, label_b = label_a or "A", label_b or "B"
    if label_a == label_b:
        label_a, label_b = f"{label_a} (A)", f"{label_b} (B)"
    return (_normalise(dfa), meta_a, label_a), (_normalise(dfb), meta_b, label_b)


def _compare_cell(key: tuple, ra: dict, rb: dict, rule: _Rule) -> dict | None:
    """One cell timed ok in both runs: its row of :attr:`CompareResult.cells` (None: a baseline row with
    ``speedups``, not compared)."""
    sa, sb = np.asarray(ra["samples_s"], dtype=float), np.asarray(rb["samples_s"], dtype=float)
    unstable = "; ".join(f"{side}: {n}" for side, n in (("A", _unstable_note(ra)), ("B", _unstable_note(rb))) if n)
    contended = "; ".join(f"{side}: {fmt_contention(r)}" for side, r in (("A", ra), ("B", rb)) if fmt_contention(r))
    row = {**_axes_dict(key), "median_a": float(ra["median_s"]), "median_b": float(rb["median_s"]),
           "n_a": int(np.isfinite(sa).sum()), "n_b": int(np.isfinite(sb).sum()), "ratio": float("nan"),
           "ci_low": float("nan"), "ci_high": float("nan"), "p_value": float("nan"), "regression": False,
           "improvement": False, "inconclusive": False, "change": "", "unstable": bool(unstable),
           "contended": contended, "load_bound": float("nan"), "note": ""}
    if rule.speedups:
        done = _speedup_cell(ra, rb, row, rule.threshold, rule.alpha)
        if done is not None and unstable:
            done["note"] = "; ".join(n for n in (done["note"], unstable) if n)
        return done
    if row["n_a"] >= 2 and row["n_b"] >= 2 and np.median(sa[np.isfinite(sa)]) > 0:
        _time_ratio(key, ra, rb, row, rule)
        significant = row["p_value"] < rule.alpha
        if unstable and significant:  # said, never silently: its median depends on which mode a run caught
            row["change"] += " (unstable cell: the difference may be a change of mode)"
        if contended and significant:  # other load while a run timed it: judged against what that load can explain
            judge_contended(row, ra, rb, rule)
    else:
        if row["median_a"] > 0:
            row["ratio"] = row["median_b"] / row["median_a"]
        row["change"] = "untested"
        row["note"] = "fewer than 2 raw samples in a run (e.g. a CSV without samples_s); only the medians compared"
    if unstable or contended:
        row["note"] = "; ".join(n for n in (row["note"], unstable, contended) if n)
    return row


def _time_ratio(key: tuple, ra: dict, rb: dict, row: dict, rule: _Rule) -> None:
    """Fill ``row`` with the ratio of the group medians, its bootstrap CI and p-value, and the verdict."""
    groups = []
    for r in (ra, rb):
        s = np.asarray(r["samples_s"], dtype=float)
        groups.append([g[np.isfinite(g)] for g in split_groups(s, r.get("sample_groups"))])
    ga, gb = groups
    row["median_a"], row["median_b"] = group_median(ga), group_median(gb)  # as `attnbench run` reports them
    row["ratio"] = row["median_b"] / row["median_a"]
    cell_seed = rule.seed ^ zlib.crc32("|".join(map(str, key)).encode())
    draws = _ratio_draws(ga, gb, rule.resamples, cell_seed, math.hypot(_row_drift(ra, rb), rule.shift_se))
    lo, hi = np.quantile(draws, [rule.alpha / 2, 1 - rule.alpha / 2])
    row["ci_low"], row["ci_high"] = float(lo), float(hi)
    # against the runs' common shift (1 without one): a cell is changed when it moved apart from the others
    own, own_lo, own_hi = (v / math.exp(rule.shift) for v in (row["ratio"], lo, hi))
    row["p_value"] = ratio_p_value(draws / math.exp(rule.shift))
    significant = row["p_value"] < rule.alpha
    row["regression"] = bool(significant and own > 1 + rule.threshold and own_lo > 1)
    row["improvement"] = bool(significant and own < 1 / (1 + rule.threshold) and own_hi < 1)
    if row["regression"]:
        row["change"] = "slower"
    elif row["improvement"]:
        row["change"] = "faster"
    elif significant and own_lo > 1:
        row["change"] = "slower, within threshold"
    elif significant and own_hi < 1:
        row["change"] = "faster, within threshold"
    else:
        row["change"] = "no significant change"


INCONCLUSIVE = "inconclusive"
"""The verdict of a significant slowdown beyond the threshold in a cell run B timed under other load (``contended``)
that the load can explain (:func:`judge_contended`): wall time then may measure the load, not the code (issue 39: ten
pairs of identical runs on a loaded machine read 11 cells changed, every one of them contended). ``attnbench compare``
exits :data:`EXIT_INCONCLUSIVE` on it (issue 45: never 0); the instruction-count layer still judges the code."""

NO_VERDICT = "no verdict"
"""How the ``change`` of a contended cell's other significant readings ends (faster, or slower within the
threshold): the load may have made them, and they would fail no gate on a quiet machine either."""

EXIT_INCONCLUSIVE = 3
"""``attnbench compare``'s exit status when a cell is :data:`INCONCLUSIVE` and none regressed (docs/exit-statuses.md:
0 passed, 1 regression, 2 nothing compared or a usage error, 3 inconclusive: rerun, then fail)."""


def row_load_bound(row: dict) -> float:
    """The largest slowdown of ``row``'s median that the load recorded with it can explain
    (:func:`attnbench.measure.contention.explainable_slowdown`); 1 for a row not timed under other load. The timed
    region's length is bounded below by the shortest group's samples (rounds, processes) times ``calls_per_sample``,
    which bounds the measure's resolution above."""
    if not fmt_contention(row):
        return 1.0
    s = np.asarray(row.get("samples_s") or [], dtype=float)
    groups = [g[np.isfinite(g)] for g in split_groups(s, row.get("sample_groups"))] if len(s) else []
    calls = float(row.get("calls_per_sample") or 1)
    region = min((float(g.sum()) for g in groups if len(g)), default=math.nan) * max(calls, 1.0)
    return contention.explainable_slowdown(_float(row.get("other_cpu_frac")), _float(row.get("steal_frac")), region)


def _float(value) -> float:
    """``value`` as a float, NaN when it is missing or not a number."""
    return float(value) if _finite(value) else math.nan


def judge_contended(row: dict, ra: dict, rb: dict, rule: _Rule) -> None:
    """The verdict of a significant difference in a cell either run timed under other load (``row`` as
    :func:`_time_ratio` filled it). Only B's load can make B read slower, by at most ``load_bound``
    (:func:`row_load_bound` of B; 1 when B was quiet): a slowdown beyond the threshold whose CI's lower bound over the
    shift exceeds it is a regression; one within it is :data:`INCONCLUSIVE`. A faster reading with A contended, and
    any reading within the threshold, is :data:`NO_VERDICT`; a faster reading beyond the threshold with only B
    contended stands (B's load cannot make B faster)."""
    bound = row_load_bound(rb)
    row["load_bound"] = bound
    if row["change"].startswith("no significant change"):  # p and the CI disagree at the edge: nothing to judge
        return
    shift = math.exp(rule.shift)
    own, own_lo = row["ratio"] / shift, row["ci_low"] / shift
    where = "in " + " and ".join(side for side, r in (("A", ra), ("B", rb)) if fmt_contention(r))
    reading = "slower" if own_lo > 1 else "faster"
    row["improvement"] = bool(row["improvement"] and not fmt_contention(ra))
    if reading == "slower" and own > 1 + rule.threshold:
        if own_lo > bound:
            row["regression"], row["change"] = True, "slower" + (
                f", beyond the {bound:.2f}x the load in B can explain" if bound > 1 else "")
            return
        row["regression"], row["inconclusive"] = False, True
        row["change"] = (f"{INCONCLUSIVE}: read slower while other load took the CPUs {where} (contended), within the "
                         f"{bound:.3g}x that load can explain; rerun on a quiet machine")
    elif not row["improvement"]:
        row["change"] = f"read {row['change'].split(' (')[0]} while other load took the CPUs {where} (contended): " \
                        f"{NO_VERDICT}"

SHIFT_MIN_CELLS = 4
"""Cells two runs must share before their common shift is estimated (fewer cannot tell a shift from one cell's change)."""


@dataclass(frozen=True)
class RunShift:
    """What every cell of run B moved by against run A alike: the median of their log ratios of medians."""

    log_ratio: float
    se: float  # its standard error (1.253 x the MAD-based SD / sqrt(cells): the median's)
    cells: int  # the cells of the cluster it was estimated from (more than half of those timed in both runs)

    def describe(self) -> str:
        pct = 100 * (math.exp(self.log_ratio) - 1)
        return (f"{self.cells} cells moved by {pct:+.1f}% alike (the median of their ratios): the machine's speed "
                "between the runs (issue 39: two identical runs 11 s apart read 0.837x); each cell is tested against "
                "that shift, not against 1, so a change that slows every cell alike is not seen here (the "
                "instruction-count layer sees it); --no-run-shift tests against 1")


def common_shift(pairs: list[tuple[dict, dict]], threshold: float = 0.10) -> RunShift | None:
    """The shift shared by most cells timed ok in both runs (``(row_a, row_b)`` pairs): between two runs on a shared
    machine every cell moves together (frequency, other tenants), and a cell whose code changed moves apart from the
    others. The estimate is the median of the largest cluster of log ratios within ``log(1 + threshold / 2)`` of one
    cell's (ties: the cluster nearest no shift); None when fewer than :data:`SHIFT_MIN_CELLS` cells or when no
    cluster holds more than half of them (the cells disagree: no shift is common to them)."""
    logs = np.asarray([math.log(float(rb["median_s"]) / float(ra["median_s"])) for ra, rb in pairs
                       if ra.get("status") == "ok" and rb.get("status") == "ok"
                       and _finite(ra.get("median_s"), rb.get("median_s")) and float(ra["median_s"]) > 0
                       and float(rb["median_s"]) > 0])
    if len(logs) < SHIFT_MIN_CELLS:
        return None
    width = math.log1p(threshold / 2)
    near = np.abs(logs[:, None] - logs[None, :]) <= width  # near[i, j]: cell j within the width of cell i
    counts = near.sum(axis=1)
    best = max(range(len(logs)), key=lambda i: (counts[i], -abs(logs[i])))
    if 2 * counts[best] <= len(logs):
        return None
    members = logs[near[best]]
    median = float(np.median(members))
    sd = 1.4826 * float(np.median(np.abs(members - median)))
    return RunShift(median, 1.2533 * sd / math.sqrt(len(members)), len(members))


def _cells_frame(rows: list[dict], rule: _Rule, any_common: bool, notes: list[str]) -> pd.DataFrame:
    """The compared cells as a frame sorted by effect (largest slowdown first); notes when nothing was comparable."""
    cells = pd.DataFrame(rows, columns=CELL_COLUMNS + (list(SPEEDUP_COLUMNS) if rule.speedups else []))
    if rule.speedups and not len(cells) and any_common:
        notes.append("no cell other than the baselines was ok in both runs; nothing to compare")
    if rule.speedups and len(cells) and not np.isfinite(cells["ci_low"]).any():
        notes.append("neither run has paired speed-ups with CIs in common cells (runs before comparison groups "
                     "were timed interleaved?); compare them without --speedups")
    if len(cells):
        cells = cells.sort_values(["regression", "ratio"], ascending=[False, not rule.speedups], na_position="last",
                                  kind="stable").reset_index(drop=True)
        for col in ("regression", "improvement", "inconclusive", "unstable"):
            cells[col] = cells[col].astype(bool)
    return cells


def _axis_mismatch(dfa: pd.DataFrame, dfb: pd.DataFrame) -> dict:
    """Axes whose value sets differ between the runs: ``{axis: {"only_in_a": [...], "only_in_b": [...]}}``."""
    mismatch = {}
    for axis in AXES:
        va, vb = set(dfa[axis]), set(dfb[axis])
        if va != vb:
            mismatch[axis] = {"only_in_a": sorted(va - vb, key=str), "only_in_b": sorted(vb - va, key=str)}
    return mismatch


# ---------------------------------------------------------------- HTML


def write_compare_html(result: CompareResult, out_dir: str | Path, dpi: int | None = None,
                       formats: str | tuple[str, ...] | None = None) -> Path:
    """Write ``compare.html`` (self-contained), the overlaid latency figures and ``compare.csv``; return the page.

    ``dpi`` and ``formats``: as :func:`attnbench.report.build_report`'s (the environment variables too)."""
    from attnbench.report import figures as figs
    from attnbench.report.page import render_settings

    with figs.rendering(render_settings(dpi, formats)):
        return _write_compare_html(result, out_dir)


def _write_compare_html(result: CompareResult, out_dir: str | Path) -> Path:
    from attnbench.report import analysis as an
    from attnbench.report import figures as figs
    from attnbench.report.page import Tables

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = Tables(out)
    dfa, dfb = result.frames if result.frames is not None else (pd.DataFrame(), pd.DataFrame())
    pa, pb = an.prepare(dfa), an.prepare(dfb)
    styles = figs.impl_styles([*pa["impl"], *pb["impl"]])
    figures = figs.latency_overlay(pa, pb, result.label_a, result.label_b, styles, out / "figures")

    c = result.cells
    head = {"impl": c["impl"], "configuration": [an.configuration_label(r) for r in c.itertuples()],
            "seq_len": c["seq_len"]}
    ratio = {"B/A": [an.fmt_num(v) + "×" if np.isfinite(v) else "–" for v in c["ratio"]],
             f"{1 - result.alpha:.0%} CI": [f"{an.fmt_num(lo)} – {an.fmt_num(hi)}" if np.isfinite(lo) else "–"
                                            for lo, hi in zip(c["ci_low"], c["ci_high"], strict=True)],
             "p": [f"{p:.2g}" if np.isfinite(p) else "–" for p in c["p_value"]]}
    if result.kind == "speedups":  # each run's paired speed-up with its CI, and their ratio
        disp = pd.DataFrame({
            **head, "baseline": c["baseline"],
            "A speed-up": [an.fmt_speedup(s, lo, hi) for s, lo, hi in zip(c["speedup_a"], c["speedup_a_low"],
                                                                            c["speedup_a_high"], strict=True)],
            "B speed-up": [an.fmt_speedup(s, lo, hi) for s, lo, hi in zip(c["speedup_b"], c["speedup_b_low"],
                                                                            c["speedup_b_high"], strict=True)],
            **ratio, "change": c["change"], "note": c["note"],
        })
        cells = tables.add("compare_speedups", disp, c, classes=_change_classes(c), long_columns=("note",))
    else:
        disp = pd.DataFrame({
            **head, "A median": [an.fmt_time(v) for v in c["median_a"]],
            "B median": [an.fmt_time(v) for v in c["median_b"]], **ratio,
            "n (A/B)": [f"{x}/{y}" for x, y in zip(c["n_a"], c["n_b"], strict=True)], "change": c["change"],
            "unstable": [n if u else "" for n, u in zip(c["note"], c["unstable"], strict=True)],
            "contended": c["contended"],
        })
        cells = tables.add("compare", disp, c, classes=_change_classes(c))
    return _render_compare_page(result, out, tables, cells, figures, styles)


def _change_classes(c: pd.DataFrame) -> list[str]:
    return ["regression" if r else "improvement" if i else "" for r, i in zip(c["regression"], c["improvement"], strict=True)]


def _render_compare_page(result: CompareResult, out: Path, tables, cells, figures, styles) -> Path:
    """``compare.html`` from its cells table and the tables every comparison has (unmatched cells, status changes)."""
    from attnbench.report import figures as figs
    from attnbench.report.page import _fmt_df, jinja_env

    t = {"cells": cells}
    t["only_a"] = tables.add("only_in_a", pd.DataFrame(result.only_in_a, columns=list(AXES)))
    t["only_b"] = tables.add("only_in_b", pd.DataFrame(result.only_in_b, columns=list(AXES)))
    t["status"] = tables.add("status_changed", _fmt_df(result.status_changed, {}), long_columns=("error_a", "error_b"))
    page = jinja_env().get_template("compare.html.j2").render(
        r=result, tables=t, figures=figures, styles=styles, n_regressions=len(result.regressions),
        n_improvements=len(result.improvements), files=[f"figures/{f.name}.{e}" for f in figures if not f.skipped
                                                          for e in figs.current_render().formats] + tables.files,
    )
    path = out / "compare.html"
    path.write_text(page, encoding="utf-8")
    return path
