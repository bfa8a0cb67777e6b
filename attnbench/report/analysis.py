"""The numbers behind a report, as plain DataFrames and sentences (no plotting, no HTML).

Every function takes the tidy results table (:data:`attnbench.results.schema.COLUMNS`) and never raises on
a table that is empty, has only failed cells, one implementation or one sequence length: what cannot
be computed is said in a ``note`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from attnbench.results.quality import NOISY_CI_REL  # noqa: F401  (one limit: the console's and the report's)
from attnbench.results.schema import AXES, INT_AXES, MODES, fill_added_columns
from attnbench.results.text import (  # noqa: F401  (fmt_bytes, fmt_speedup: the report's figures and pages read them from here too)
    axis_label,
    cell_label,
    configuration_label,
    fmt_bytes,
    fmt_ci,
    fmt_contention,
    fmt_num,
    fmt_speedup,
    fmt_time,
    time_unit,
)

GROUP_AXES = ("device", "dtype", "mode", "cache", "batch", "num_heads", "d_model", "num_kv_heads", "window", "causal",
              "positional", "inputs", "lengths", "batch_spec")  # inputs: issue 38; lengths: issue 37; batch_spec: 48
"""The axes that define one panel/configuration; within it, lines are implementations over ``seq_len``."""



# ---------------------------------------------------------------- formatting (one definition, in results.text)

def t_range(ts) -> str:
    """``T=32–1024`` or ``T=128``."""
    ts = sorted(int(t) for t in ts)
    if not ts:
        return "no T"
    return f"T={ts[0]}" if ts[0] == ts[-1] else f"T={ts[0]}–{ts[-1]}"


# ---------------------------------------------------------------- preparation


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with clean types: axes as str/int, measurements as float, ``ok`` only with a finite median."""
    df = fill_added_columns(df.copy())
    df["window"] = pd.to_numeric(df["window"], errors="coerce").fillna(0).astype("int64")  # 0: full attention
    df["causal"] = df["causal"].fillna(True).astype(bool)
    if "num_kv_heads" in df.columns:  # absent only when num_heads is too
        df["num_kv_heads"] = pd.to_numeric(df["num_kv_heads"], errors="coerce").fillna(0).astype("int64")
    for col in ("impl", "device", "dtype", "mode", "cache", "status", "error", "notes", "cell_id", "baseline", "group_id",
                "positional", "inputs"):
        if col in df.columns:
            df[col] = df[col].astype(object).where(df[col].notna(), "").astype(str)
    for col in INT_AXES:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce").fillna(0).astype("int64")
    for col in ("median_s", "iqr_s", "ci_low_s", "ci_high_s", "ci_rel", "ci_within_rel", "peak_bytes", "gflops_per_s",
                "peak_gflops_per_s", "frac_peak", "compile_s", "flops", "mean_s", "min_s", "max_s", "speedup",
                "speedup_ci_low", "speedup_ci_high"):
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    if "ci_rel" in df.columns:  # a run's own noise: its CI before the between-run term (older runs have only ci_rel)
        within = df["ci_within_rel"] if "ci_within_rel" in df.columns else df["ci_rel"]
        df["noise_rel"] = within.where(within.notna(), df["ci_rel"])
    if "samples_s" not in df.columns:
        df["samples_s"] = [[] for _ in range(len(df))]
    df["samples_s"] = df["samples_s"].apply(lambda v: [] if v is None or isinstance(v, str) else list(v))
    _python_strings(df)
    bad_ok = (df["status"] == "ok") & ~np.isfinite(df["median_s"].to_numpy(dtype=float))
    if bad_ok.any():  # a row that says ok but has no timing cannot be plotted as ok
        df.loc[bad_ok, "status"] = "invalid"
        df.loc[bad_ok, "error"] = "status ok but no finite median_s in the results file"
    return df.copy()  # a deep copy consolidates the columns set one by one above into a block per dtype: every row
    # selection (the report makes hundreds) then takes from a few blocks instead of one per column


PYTHON_STR = pd.StringDtype("python", na_value=np.nan)


def _python_strings(df: pd.DataFrame) -> None:
    """Text columns kept as pandas' ``str`` dtype, stored as Python strings rather than Arrow arrays (in place):
    the report filters its ~100-column frame hundreds of times, and selecting rows from Arrow-backed text columns
    costs about three times as much (a second of the default sweep's report)."""
    for col in df.columns:
        dtype = df[col].dtype
        if isinstance(dtype, pd.StringDtype) and dtype.storage == "pyarrow" and dtype.na_value is not pd.NA:
            df[col] = df[col].astype(PYTHON_STR)


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The successfully timed cells."""
    return df[df["status"] == "ok"]


def impl_order(df: pd.DataFrame) -> list[str]:
    """Implementations in order of first appearance (the order the run swept them)."""
    return list(dict.fromkeys(df["impl"].tolist()))


def _mode_rank(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


_DTYPE_ORDER = ("float32", "bfloat16", "float16", "float64")


def _dtype_rank(dtype: str) -> int:
    return _DTYPE_ORDER.index(dtype) if dtype in _DTYPE_ORDER else len(_DTYPE_ORDER)


@dataclass
class Group:
    """One configuration (every axis but ``impl`` and ``seq_len`` fixed): a panel in the figures."""

    key: tuple
    values: dict
    label: str  # the varying parts only (panel title)
    full_label: str  # every part (tables, sentences)
    rows: pd.DataFrame = field(repr=False)


def varying_axes(df: pd.DataFrame) -> list[str]:
    """Group axes that take more than one value in ``df``."""
    return [a for a in GROUP_AXES if a in df.columns and df[a].nunique() > 1]


def _default_axis(df: pd.DataFrame, axis: str) -> bool:
    """Whether ``axis`` holds its unremarkable default throughout ``df`` (warm cache, MHA, full causal attention)."""
    value = df[axis].iloc[0]
    if axis == "num_kv_heads":
        return bool((df["num_kv_heads"] == df["num_heads"]).all()) or not value
    return {"cache": value == "warm", "window": not value, "causal": bool(value) is True,
            "positional": not value, "inputs": value in ("normal", ""), "lengths": not value,
            "batch_spec": not value}.get(axis, False)


def common_label(df: pd.DataFrame) -> str:
    """The group axes constant over ``df``'s successful cells (all cells if none), as one line (figure titles)."""
    if "status" in df.columns and (df["status"] == "ok").any():
        df = df[df["status"] == "ok"]
    parts = [axis_label(a, df[a].iloc[0]) for a in GROUP_AXES
             if a in df.columns and len(df) and df[a].nunique() == 1 and not _default_axis(df, a)]
    return " · ".join(parts)


def groups(df: pd.DataFrame) -> list[Group]:
    """The configurations in ``df``, ordered device, dtype, mode (inference first), then sizes."""
    if df.empty:
        return []
    ok = ok_rows(df)
    vary = varying_axes(ok if len(ok) else df)  # panel titles name what varies among the drawn panels
    out = []
    for key, rows in df.groupby(list(GROUP_AXES), sort=False, dropna=False):
        values = dict(zip(GROUP_AXES, key, strict=True))
        label = " · ".join(axis_label(a, values[a]) for a in vary) or common_label(ok if len(ok) else df) or "all cells"
        out.append(Group(tuple(key), values, label, configuration_label(values), rows))
    out.sort(key=lambda g: (g.values["device"], _dtype_rank(g.values["dtype"]), g.values["dtype"],
                            _mode_rank(g.values["mode"]), g.values["mode"],
                            g.values["cache"], g.values["batch"], g.values["num_heads"], g.values["d_model"],
                            -g.values["num_kv_heads"], g.values["window"], not g.values["causal"]))
    return out


# ---------------------------------------------------------------- baseline, summary


def choose_baseline(df: pd.DataFrame, requested: str | None) -> tuple[str | None, str | None]:
    """``(baseline, note)``: the requested implementation when it has successful cells, else the first one that does.

    ``note`` says what happened when the request could not be honoured (``None`` otherwise).
    """
    ok = ok_rows(df)
    present = impl_order(ok)
    if not present:
        return None, "no implementation has a successful cell, so there is no baseline to compare against"
    if requested and requested in present:
        return requested, None
    if requested and requested in set(df["impl"]):
        why = f"baseline {requested!r} has no successful cell in this run"
    elif requested:
        why = f"baseline {requested!r} is not in this run"
    else:
        why = "no baseline was requested"
    return present[0], f"{why}; using {present[0]!r} instead (the first implementation with successful cells)"


def status_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Cells per implementation and status (columns: impl, ok, oom, error, ..., total)."""
    from attnbench.results.schema import STATUSES

    if df.empty:
        return pd.DataFrame(columns=["impl", *STATUSES, "total"])
    table = pd.crosstab(df["impl"], df["status"])
    for s in STATUSES:
        if s not in table.columns:
            table[s] = 0
    extra = [c for c in table.columns if c not in STATUSES]
    table = table[[*STATUSES, *extra]]
    table["total"] = table.sum(axis=1)
    table = table.reindex(impl_order(df))
    return table.reset_index().rename(columns={"index": "impl"})


# ---------------------------------------------------------------- fastest, speed-up, crossovers


def _overlap(a: pd.Series, b: pd.Series) -> bool:
    """Do the median CIs of two rows overlap (False when a CI is missing)?"""
    lo = (a["ci_low_s"], b["ci_low_s"])
    hi = (a["ci_high_s"], b["ci_high_s"])
    if not all(np.isfinite(v) for v in (*lo, *hi)):
        return False
    return max(lo) <= min(hi)


def _paired_cells(cells: pd.DataFrame) -> bool:
    """Whether every cell has a finite paired speed-up against one common baseline."""
    if "speedup" not in cells.columns or "baseline" not in cells.columns:
        return False
    base = cells["baseline"].astype(object).where(cells["baseline"].notna(), "").astype(str)
    return bool(np.isfinite(pd.to_numeric(cells["speedup"], errors="coerce")).all() and base.nunique() == 1
                and base.iloc[0] != "")


def fastest(df: pd.DataFrame) -> pd.DataFrame:
    """The fastest implementation of every (configuration, seq_len), with the runner-up and its margin.

    When every member there has a paired speed-up against the same baseline, the order and the margin come
    from those (a ratio of paired speed-ups is itself paired); otherwise from the medians."""
    cols = ["configuration", "seq_len", "fastest", "median", "ci", "runner_up", "runner_up_slower_x", "n_impls", "note"]
    rows = []
    for g in groups(ok_rows(df)):
        for t, cells in g.rows.groupby("seq_len", sort=True):
            paired = _paired_cells(cells)
            # paired speed-ups against one baseline order the members with the drift they share cancelled
            cells = cells.sort_values("speedup", ascending=False) if paired else cells.sort_values("median_s")
            best = cells.iloc[0]
            notes = []
            if best["noise_rel"] > NOISY_CI_REL:
                notes.append("noisy")
            if str(best.get("stability")) == "unstable":
                notes.append("unstable")
            if str(best.get("contended")) == "yes":  # others took the CPUs while it was timed
                notes.append("contended")
            second = cells.iloc[1] if len(cells) > 1 else None
            if second is not None and _overlap(best, second):
                notes.append("tie within CI")
            rows.append({
                "configuration": g.full_label, "seq_len": int(t), "fastest": best["impl"],
                "median": fmt_time(best["median_s"]),
                "ci": fmt_ci(best["ci_low_s"], best["ci_high_s"]),
                "runner_up": second["impl"] if second is not None else "–",
                "runner_up_slower_x": ("–" if second is None else fmt_num(best["speedup"] / second["speedup"]) if paired
                                       else fmt_num(second["median_s"] / best["median_s"])),
                "n_impls": len(cells), "note": ", ".join(notes),
            })
    return pd.DataFrame(rows, columns=cols)


def paired_baseline(df: pd.DataFrame) -> str | None:
    """The baseline of the run's paired speed-ups (the ``baseline`` of most ok rows with a finite ``speedup``),
    or ``None`` for a run measured before comparison groups were timed interleaved."""
    if "speedup" not in df.columns or "baseline" not in df.columns:
        return None
    ok = ok_rows(df)
    has = ok[np.isfinite(pd.to_numeric(ok["speedup"], errors="coerce").to_numpy(dtype=float))]
    names = has["baseline"].dropna().astype(str)
    names = names[names != ""]
    return str(names.value_counts().index[0]) if len(names) else None


SPEEDUP_COLUMNS = ["group", "configuration", "impl", "seq_len", "median_s", "baseline_median_s", "speedup",
                   "speedup_ci_low", "speedup_ci_high", "paired", "unstable", "note"]


def speedups(df: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """The speed-up over ``baseline`` (> 1: faster) per (configuration, seq_len, impl), with its 95% CI.

    A row measured in a comparison group against this baseline gives its **paired** speed-up (the
    ``speedup`` column and its CI, from per-cycle ratios of interleaved bursts: drift shared by the members
    cancels); ``paired`` is then True. Otherwise (a run from before paired speed-ups, or another baseline
    than the run's) it is the ratio of medians, ``baseline median / impl median``, without a CI. A row of a
    group whose pairing failed (the baseline failed, ...) is left out: its ``notes`` say why.
    ``unstable``: the member or its baseline was flagged unstable (two modes), so the speed-up may move
    between runs.
    """
    if baseline is None:
        return pd.DataFrame(columns=SPEEDUP_COLUMNS)
    rows = []
    have_paired = "speedup" in df.columns and "baseline" in df.columns
    for gi, g in enumerate(groups(ok_rows(df))):
        base_rows = g.rows[g.rows["impl"] == baseline]
        base = base_rows.groupby("seq_len")["median_s"].median()
        base_unstable = set(base_rows.loc[_unstable_mask(base_rows), "seq_len"])
        for r in g.rows.itertuples():
            row_baseline = str(getattr(r, "baseline", "") or "") if have_paired else ""
            sp = float(getattr(r, "speedup", float("nan"))) if have_paired else float("nan")
            paired = row_baseline == baseline and math.isfinite(sp)
            if row_baseline == baseline and not paired and r.impl != baseline:
                continue  # measured against this baseline but could not be paired: its notes say why
            if not paired and r.seq_len not in base.index:
                continue
            b = float(base.loc[r.seq_len]) if r.seq_len in base.index else float("nan")
            unstable = str(getattr(r, "stability", "")) == "unstable" or r.seq_len in base_unstable
            rows.append({"group": gi, "configuration": g.full_label, "impl": r.impl, "seq_len": int(r.seq_len),
                         "median_s": r.median_s, "baseline_median_s": b,
                         "speedup": sp if paired else b / r.median_s,
                         "speedup_ci_low": float(r.speedup_ci_low) if paired else float("nan"),
                         "speedup_ci_high": float(r.speedup_ci_high) if paired else float("nan"),
                         "paired": paired, "unstable": unstable and r.impl != baseline,
                         "note": "unstable: the speed-up may move between runs" if unstable and r.impl != baseline
                         else ""})
    out = pd.DataFrame(rows, columns=SPEEDUP_COLUMNS)
    out["paired"] = out["paired"].astype(bool)
    out["unstable"] = out["unstable"].astype(bool)
    return out


def unpaired(df: pd.DataFrame, baseline: str | None) -> list[str]:
    """``cell: notes`` of every ok cell measured against ``baseline`` whose speed-up could not be paired (the
    baseline failed in its group, ...): :func:`speedups` leaves them out, the report lists them."""
    if baseline is None or "speedup" not in df.columns or "baseline" not in df.columns:
        return []
    ok = ok_rows(df)
    bad = ok[(ok["baseline"] == baseline) & (ok["impl"] != baseline) & ~np.isfinite(ok["speedup"].astype(float))]
    return [f"{cell_label(r)}: {r.notes or 'no reason recorded'}" for r in bad.itertuples()]


def _unstable_mask(rows: pd.DataFrame) -> pd.Series:
    if "stability" not in rows.columns:
        return pd.Series(False, index=rows.index)
    return rows["stability"].astype(str) == "unstable"


def speedup_method(sp: pd.DataFrame) -> str:
    """``paired``, ``medians`` or ``mixed``: how the speed-ups of :func:`speedups` were computed."""
    if sp.empty or sp["paired"].all():
        return "paired" if len(sp) else "medians"
    return "medians" if not sp["paired"].any() else "mixed"


def geometric_mean_speedups(sp: pd.DataFrame) -> pd.Series:
    """Per implementation, the geometric mean of its speed-ups over every configuration and T (descending)."""
    good = sp[np.isfinite(sp["speedup"]) & (sp["speedup"] > 0)]
    if good.empty:
        return pd.Series(dtype=float)
    return np.exp(np.log(good["speedup"]).groupby(good["impl"]).mean()).sort_values(ascending=False)


@dataclass
class SpeedupGrid:
    """Speed-ups as implementation x shape: ``speedup`` (NaN where not measured) and ``text`` (the annotation:
    speed-up, its paired CI on a second line, ``unstable`` on a third), rows ordered by geometric-mean speed-up
    (fastest first), columns ``(group index, seq_len)`` with ``labels`` naming the shape."""

    speedup: pd.DataFrame
    text: pd.DataFrame
    labels: list[str]


def speedup_grid(df: pd.DataFrame, sp: pd.DataFrame, baseline: str) -> SpeedupGrid:
    """The heatmap's numbers (see :class:`SpeedupGrid`): every implementation but ``baseline`` against every
    (configuration, T) of ``sp`` (:func:`speedups`); a column's label names the configuration axes that vary
    among the columns, and T."""
    rest = sp[(sp["impl"] != baseline) & np.isfinite(sp["speedup"]) & (sp["speedup"] > 0)]
    order = list(geometric_mean_speedups(rest).index)
    cols = sorted({(int(gi), int(t)) for gi, t in zip(rest["group"], rest["seq_len"], strict=True)})
    gs = groups(ok_rows(df))
    vary = varying_axes(pd.DataFrame([gs[gi].values for gi, _ in cols])) if cols else []
    labels = ["\n".join([*(axis_label(a, gs[gi].values[a]) for a in vary), axis_label("seq_len", t)]) for gi, t in cols]
    speed = pd.DataFrame(np.nan, index=order, columns=pd.MultiIndex.from_tuples(cols, names=["group", "seq_len"])
                         if cols else None)
    text = pd.DataFrame("–", index=order, columns=speed.columns)
    for r in rest.itertuples():
        key = (int(r.group), int(r.seq_len))
        speed.loc[r.impl, key] = r.speedup
        lines = [f"{r.speedup:.2f}×"]
        if r.paired and math.isfinite(r.speedup_ci_low):
            lines.append(f"{r.speedup_ci_low:.2f}–{r.speedup_ci_high:.2f}")
        if r.unstable:
            lines.append("unstable")
        text.loc[r.impl, key] = "\n".join(lines)
    return SpeedupGrid(speed, text, labels)


def speedup_sentences(sp: pd.DataFrame, baseline: str | None) -> dict[str, list[str]]:
    """Per configuration, one sentence per implementation: its speed-up over ``baseline`` at each T, with the
    paired CI where there is one, and whether that CI excludes 1 (a difference the run can tell)."""
    out: dict[str, list[str]] = {}
    if baseline is None or sp.empty:
        return out
    for conf, part in sp[sp["impl"] != baseline].groupby("configuration", sort=False):
        for impl in impl_order(part):
            r = part[part["impl"] == impl].sort_values("seq_len")
            bits, clear_fast, clear_slow, unclear = [], [], [], []
            for x in r.itertuples():
                bits.append(f"{fmt_speedup(x.speedup, x.speedup_ci_low, x.speedup_ci_high)} at T={x.seq_len}")
                if x.paired and math.isfinite(x.speedup_ci_low):
                    (clear_fast if x.speedup_ci_low > 1 else clear_slow if x.speedup_ci_high < 1 else unclear).append(
                        x.seq_len)
            how = "paired, 95% CI" if r["paired"].all() else "ratio of medians, no CI"
            text = f"{impl} vs {baseline} ({how}): {'; '.join(bits)}."
            if unclear:
                text += f" At T={', '.join(map(str, unclear))} the CI includes 1: no difference the run can tell."
            if r["unstable"].any():
                text += (" Unstable at T=" + ", ".join(str(t) for t in r.loc[r["unstable"], "seq_len"])
                         + ": the speed-up there may move between runs.")
            out.setdefault(conf, []).append(text)
    return out


def _order_sentence(a: str, b: str, ts: list[int], faster: list[bool], where: str) -> tuple[str, int | None]:
    """One sentence about how ``a`` compares with ``b`` over ``ts`` (``faster[i]``: a is faster at ts[i])."""
    span = f"({t_range(ts)})"
    if all(faster):
        return f"{a} is faster than {b} at every T measured {span} on {where}.", None
    if not any(faster):
        return f"{a} is slower than {b} at every T measured {span} on {where}.", None
    changes = [i for i in range(1, len(ts)) if faster[i] != faster[i - 1]]
    if len(changes) == 1:
        i = changes[0]
        if faster[i]:
            return (f"{a} is faster than {b} from T >= {ts[i]} on {where} "
                    f"(slower up to T <= {ts[i - 1]}).", ts[i])
        return (f"{a} is faster than {b} up to T <= {ts[i - 1]} on {where}; "
                f"{b} is faster from T >= {ts[i]}.", ts[i])
    fast = ", ".join(str(t) for t, f in zip(ts, faster, strict=True) if f)
    slow = ", ".join(str(t) for t, f in zip(ts, faster, strict=True) if not f)
    return (f"{a} and {b} change order {len(changes)} times on {where}: {a} is faster at T = {fast} "
            f"and slower at T = {slow} (differences this small are often noise).", ts[changes[0]])


def crossovers(df: pd.DataFrame, baseline: str | None, sp: pd.DataFrame | None = None) -> tuple[pd.DataFrame, list[str]]:
    """How each implementation compares with every other over ``seq_len``, per configuration.

    Returns ``(table, notes)``. The table has one row per (configuration, a, b) pair with at least two
    common sequence lengths: ``kind`` is ``always_faster``, ``always_slower``, ``crossover`` or ``mixed``,
    ``crossover_T`` the first T of the new order, ``vs_baseline`` whether ``b`` is the baseline, and
    ``sentence`` says it in words (``short``: the same without the configuration, for under a heading).
    ``notes`` explain configurations where nothing could be said. With ``sp`` (:func:`speedups`), a pair
    with the baseline is ordered by its paired speed-ups where it has them (> 1: faster), not by medians.
    """
    cols = ["configuration", "a", "b", "vs_baseline", "kind", "crossover_T", "n_T", "sentence", "short"]
    rows, notes = [], []
    for g in groups(ok_rows(df)):
        med = g.rows.pivot_table(index="seq_len", columns="impl", values="median_s", aggfunc="median")
        impls = [i for i in impl_order(g.rows) if i in med.columns]
        if len(impls) < 2:
            notes.append(f"{g.full_label}: only {impls[0] if impls else 'no implementation'} has successful cells, "
                         "nothing to compare.")
            continue
        if len(med.index) < 2:
            order = med.iloc[0].dropna().sort_values()
            notes.append(f"{g.full_label}: one sequence length (T={int(med.index[0])}), so no crossover can be "
                         f"found; the order there is {' < '.join(order.index)}.")
            continue
        pairs = [(a, baseline) for a in impls if baseline in impls and a != baseline]
        pairs += [(a, b) for i, a in enumerate(impls) for b in impls[i + 1:] if baseline not in (a, b)]
        paired = {}
        if sp is not None and len(sp) and baseline in impls:
            mine = sp[(sp["configuration"] == g.full_label) & sp["paired"]]
            paired = {i: part.set_index("seq_len")["speedup"] for i, part in mine.groupby("impl")}
        ts_all, medians = med.index.to_numpy(), {i: med[i].to_numpy(dtype=float) for i in impls}  # numpy: 100s of pairs
        for a, b in pairs:
            if b == baseline and a in paired:  # a baseline / a time: the paired speed-up stands for the ratio
                both = pd.DataFrame({a: 1.0 / paired[a], b: 1.0}).sort_index().dropna()
                t_both, ya, yb = both.index.to_numpy(), both[a].to_numpy(), both[b].to_numpy()
            else:
                keep = ~(np.isnan(medians[a]) | np.isnan(medians[b]))
                t_both, ya, yb = ts_all[keep], medians[a][keep], medians[b][keep]
            if len(t_both) < 2:
                continue
            ts = [int(t) for t in t_both]
            faster = [bool(x) for x in (ya < yb)]
            if not any(faster) and b != baseline:
                a, b, faster = b, a, [not f for f in faster]  # state it from the side that ends up faster
            sentence, t_cross = _order_sentence(a, b, ts, faster, g.full_label)
            changes = sum(faster[i] != faster[i - 1] for i in range(1, len(faster)))
            kind = ("always_faster" if all(faster) else "always_slower" if not any(faster)
                    else "crossover" if changes == 1 else "mixed")
            rows.append({"configuration": g.full_label, "a": a, "b": b, "vs_baseline": b == baseline, "kind": kind,
                         "crossover_T": t_cross, "n_T": len(ts), "sentence": sentence,
                         "short": sentence.replace(f" on {g.full_label}", "")})
    return pd.DataFrame(rows, columns=cols), notes


# ---------------------------------------------------------------- scaling exponents


def _fit(ts: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
    """Least-squares slope and R² of ``log y`` on ``log T``."""
    x, y = np.log(ts), np.log(ys)
    k, c = np.polyfit(x, y, 1)
    resid = y - (k * x + c)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss if ss > 0 else float("nan")
    return float(k), r2


def scaling(df: pd.DataFrame, column: str = "median_s", min_points: int = 3) -> pd.DataFrame:
    """The exponent ``k`` of ``column ∝ T^k`` per (implementation, configuration), fitted in log-log space.

    ``k_all`` fits every distinct T (at least ``min_points``); ``k_tail`` only the three largest (when
    there are four or more: small T is often dominated by fixed overheads). ``note`` says why a fit is missing.
    """
    cols = ["impl", "configuration", "n_T", "T_range", "k_all", "r2", "k_tail", "note"]
    rows = []
    for g in groups(ok_rows(df)):
        for impl in impl_order(g.rows):
            cells = g.rows[g.rows["impl"] == impl]
            vals = cells.groupby("seq_len")[column].median()
            positive = vals[np.isfinite(vals) & (vals > 0)]
            row = {"impl": impl, "configuration": g.full_label, "n_T": len(positive), "T_range": t_range(vals.index),
                   "k_all": float("nan"), "r2": float("nan"), "k_tail": float("nan"), "note": ""}
            if len(positive) < min_points:
                if len(positive) == 0:
                    row["note"] = f"no {column} measured"
                else:
                    row["note"] = (f"needs >= {min_points} distinct T with a measurement to fit a slope; "
                                   f"has {len(positive)}")
            else:
                ts, ys = positive.index.to_numpy(dtype=float), positive.to_numpy(dtype=float)
                row["k_all"], row["r2"] = _fit(ts, ys)
                if len(positive) >= 4:
                    row["k_tail"], _ = _fit(ts[-3:], ys[-3:])
            rows.append(row)
    return pd.DataFrame(rows, columns=cols)


# ---------------------------------------------------------------- noisy and failed cells, compile


def noisy(df: pd.DataFrame, limit: float = NOISY_CI_REL) -> pd.DataFrame:
    """Successful cells whose within-run CI half-width (``noise_rel``: before the between-run term, which more
    samples cannot shrink) exceeds ``limit`` of the median, or that were flagged ``unstable`` (two modes;
    ``unstable`` holds the modes) or ``contended`` (other processes or steal took the CPUs while they were timed;
    ``contended`` says how much), noisiest first. ``ci`` is the reported CI, between-run term included."""
    ok = ok_rows(df)
    unstable = (ok["stability"].astype(str) == "unstable") if "stability" in ok else pd.Series(False, index=ok.index)
    contended = (ok["contended"].astype(str) == "yes") if "contended" in ok else pd.Series(False, index=ok.index)
    bad = ok[(ok["noise_rel"] > limit) | unstable | contended].sort_values("noise_rel", ascending=False)
    return pd.DataFrame({
        "cell": [cell_label(r) for r in bad.itertuples()],
        "median": [fmt_time(v) for v in bad["median_s"]],
        "ci": [fmt_ci(lo, hi) for lo, hi in zip(bad["ci_low_s"], bad["ci_high_s"], strict=True)],
        "ci_rel_pct": [f"±{100 * v:.1f}%" for v in bad["noise_rel"]],
        "n": bad["n"].tolist() if "n" in bad else [],
        "unstable": [next((n for n in str(notes).split("; ") if n.startswith("unstable")), "") if flag else ""
                     for notes, flag in zip(bad["notes"], unstable[bad.index], strict=True)],
        "contended": [fmt_contention(r) for r in bad.to_dict("records")],
    }, columns=["cell", "median", "ci", "ci_rel_pct", "n", "unstable", "contended"])


def failures(df: pd.DataFrame) -> pd.DataFrame:
    """Every cell that is not ``ok``: its axes, status and error text."""
    bad = df[df["status"] != "ok"]
    return pd.DataFrame({
        "impl": bad["impl"].tolist(),
        "configuration": [configuration_label(r) for r in bad.itertuples()],
        "seq_len": bad["seq_len"].tolist(),
        "status": bad["status"].tolist(),
        "error": [(e or n or "").strip() for e, n in zip(bad["error"], bad["notes"], strict=True)],
    }, columns=["impl", "configuration", "seq_len", "status", "error"])


def eager_name(impl: str) -> str | None:
    """``weight_split`` for ``compiled:weight_split@max-autotune``; ``None`` for a non-compiled name."""
    if not impl.startswith("compiled:"):
        return None
    return impl[len("compiled:"):].split("@", 1)[0]


def compile_table(df: pd.DataFrame) -> pd.DataFrame:
    """``compiled:`` cells: compile time, steady-state median, the eager median and the calls to break even."""
    cols = ["impl", "configuration", "seq_len", "compile_s", "median_s", "eager_median_s", "speedup_vs_eager",
            "break_even_calls"]
    ok = ok_rows(df)
    comp = ok[ok["impl"].str.startswith("compiled:")]
    rows = []
    for r in comp.itertuples():
        eager = ok[(ok["impl"] == eager_name(r.impl)) & (ok["seq_len"] == r.seq_len)]
        for a in GROUP_AXES:
            eager = eager[eager[a] == getattr(r, a)]
        e = float(eager["median_s"].iloc[0]) if len(eager) else float("nan")
        gain = e - r.median_s
        if not np.isfinite(e) or not np.isfinite(r.compile_s):
            be = float("nan")
        else:
            be = math.ceil(r.compile_s / gain) if gain > 0 else float("inf")
        rows.append({"impl": r.impl, "configuration": configuration_label(r), "seq_len": int(r.seq_len),
                     "compile_s": r.compile_s, "median_s": r.median_s,
                     "eager_median_s": e, "speedup_vs_eager": e / r.median_s if np.isfinite(e) else float("nan"),
                     "break_even_calls": be})
    return pd.DataFrame(rows, columns=cols)


def bar_choice(df: pd.DataFrame) -> tuple[Group, int] | None:
    """The configuration of the bar chart: the first configuration's largest T common to most implementations."""
    gs = groups(ok_rows(df))
    if not gs:
        return None
    g = gs[0]
    counts = g.rows.groupby("seq_len")["impl"].nunique()
    best = counts.max()
    t = int(max(t for t, c in counts.items() if c == best))
    return g, t


def cell_key(row) -> tuple:
    """The :data:`~attnbench.results.schema.AXES` values of a row, as a tuple."""
    return tuple(row[a] for a in AXES)


# ---------------------------------------------------------------- profiler op tables


def profile_tables(ops: pd.DataFrame, top: int = 15) -> list[dict]:
    """Per configuration, the top operators by self time, one column per implementation (side by side).

    ``ops`` is ``<run>/profile/ops.parquet``. Device self time is used when any op has some (GPU runs),
    else CPU self time. Returns ``[{"configuration", "time_column", "table"}]``.
    """
    if ops is None or ops.empty:
        return []
    ops = ops.copy()
    ops["impl"] = ops["impl"].astype(str)
    cid = ops["cell_id"].astype(str) if "cell_id" in ops else pd.Series([""] * len(ops))
    ops["configuration"] = [c.split("|", 1)[1] if "|" in c else c for c in cid]
    out = []
    for conf, part in ops.groupby("configuration", sort=True):
        device_t = pd.to_numeric(part.get("self_device_s", pd.Series(dtype=float)), errors="coerce").fillna(0)
        use_device = bool(device_t.gt(0).any())
        tcol = "self_device_s" if use_device else "self_cpu_s"
        part = part.assign(_t=pd.to_numeric(part[tcol], errors="coerce").fillna(0.0),
                           _calls=pd.to_numeric(part.get("calls", 0), errors="coerce").fillna(0))
        agg = part.groupby(["impl", "op"], sort=False).agg(t=("_t", "sum"), calls=("_calls", "sum")).reset_index()
        impls = list(dict.fromkeys(part["impl"]))
        keep: list[str] = []
        for impl in impls:
            top_ops = agg[agg["impl"] == impl].sort_values("t", ascending=False).head(top)["op"].tolist()
            keep += [o for o in top_ops if o not in keep]
        totals = agg.groupby("impl")["t"].sum()
        table = pd.DataFrame({"op": keep})
        for impl in impls:
            sub = agg[agg["impl"] == impl].set_index("op")
            table[f"{impl} self"] = [fmt_time(sub["t"].get(o, float("nan"))) if o in sub.index else "–" for o in keep]
            table[f"{impl} %"] = [f"{100 * sub['t'].get(o) / totals[impl]:.1f}%" if o in sub.index and totals[impl] > 0
                                  else "–" for o in keep]
            table[f"{impl} calls"] = [str(int(sub["calls"].get(o))) if o in sub.index else "–" for o in keep]
        first = impls[0]
        order = agg[agg["impl"] == first].set_index("op")["t"]
        table["_sort"] = [-(order.get(o, 0.0)) for o in keep]
        table = table.sort_values("_sort", kind="stable").drop(columns="_sort").reset_index(drop=True)
        table.loc[len(table)] = ["total (all ops)"] + sum(
            ([fmt_time(totals[i]), "100%", str(int(agg[agg["impl"] == i]["calls"].sum()))] for i in impls), [])
        out.append({"configuration": conf, "time_column": tcol, "table": table})
    return out
