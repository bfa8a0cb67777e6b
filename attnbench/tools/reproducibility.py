"""Reproducibility benchmark: K independent runs of one fixed sweep, and how well they agree.

Run it as a script (it is a benchmark, not a unit test)::

    python -m attnbench.tools.reproducibility [--runs 4] [--cpu-allocator pinned,system] [--rounds 3]

Each run is a fresh ``attnbench run`` process (its own measuring workers), so everything a process
inherits by chance (allocator state, thread placement, what ran before) differs between runs as it
would between two users' runs. With several allocators the runs are interleaved (run 1 of each, then
run 2 of each, ...) so that a slow phase of the machine hits all of them alike. Per cell it prints the
max/min ratio of the medians across runs, how often one run's 95% CI covered another run's median,
whether the runs ranked every pair of implementations the same way, and whether any run flagged the
cell unstable; then a summary per allocator (worst and mean max/min, coverage %, ranking agreement %).

The CIs checked are the ones the runs report: their own (``ci_within_rel``) widened by the between-run
term (:mod:`attnbench.measure.drift`); the coverage of the within-run CIs alone is printed next to it.
Every summary also estimates that term from its runs; ``--calibrate`` stores the estimate as this machine's
(per device type and allocator), which later runs use. Calibrate on one set of runs and check coverage on
another: coverage measured on the calibration runs themselves is optimistic.

The whole set of runs holds the machine's measurement lock (:mod:`attnbench.measure.machine_lock`), so no other
measurement slips in between them; each run measures under it (it finds the lock held by this process).
``--speedups`` adds the same questions about the speed-ups against each comparison group's baseline
(:func:`speedup_agreement`): how far each paired speed-up moves between runs (max/min, worst and mean; next
to it the ratio of medians, the unpaired speed-up, for comparison), how often one run's paired CI covers another
run's speed-up, and whether a speed-up whose CI excludes 1 ever lands on the other side of 1 in another run.
``--load memory|cpu`` runs a contention generator on the spare core for the whole set
(:mod:`attnbench.tools.load`; bounded, and stopped when the tool ends). ``--baseline IMPL`` and anything
after ``--`` go to every ``attnbench run``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from attnbench.devices import parse_device_type
from attnbench.measure import drift, machine_lock, speedup_spread
from attnbench.results.schema import AXES
from attnbench.results.store import load_run
from attnbench.tools import identical_pairs
from attnbench.tools import load as contention_load

CONFIG = [a for a in AXES if a != "impl"]
"""The axes that make a configuration; implementations are ranked within one."""


def run_once(args: argparse.Namespace, allocator: str, out: Path) -> Path:
    """One ``attnbench run`` in a fresh process; its run folder."""
    cmd = [sys.executable, "-m", "attnbench", "run", "--impl", args.impl, "--seq", args.seq, "--batch", args.batch,
           "--heads", args.heads, "--d-model", args.d_model, "--mode", args.mode, "--rounds", str(args.rounds),
           "--processes", str(args.processes), "--budget", str(args.budget), "--cpu-allocator", allocator,
           "--device", args.device, "--out", str(out), "--json", "--no-report"]
    if args.drift is not None:
        cmd += ["--drift", args.drift]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.baseline:
        cmd += ["--baseline", args.baseline]
    cmd += list(getattr(args, "run_args", []))  # what followed `--`: attnbench run's own options
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():  # 1: the run ended, some cells failed (their rows say why)
        raise SystemExit(f"reproducibility: `{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return Path(json.loads(proc.stdout)["run_dir"])


def agreement(frames: list[pd.DataFrame]) -> tuple[pd.DataFrame, dict]:
    """Per-cell agreement of several runs of the same sweep, and the summary figures.

    A run's CI *covers* another run's median when that median lies inside it; coverage is counted
    over ordered pairs of runs. A pair of implementations *agrees* when every run orders their
    medians the same way.
    """
    ok = pd.concat([f.assign(run=i) for i, f in enumerate(frames)])
    ok = ok[ok.status == "ok"]
    rows = []
    for cell_id, g in ok.groupby("cell_id", sort=False):
        if len(g) < 2:
            continue
        med = g.median_s.to_numpy()
        i, j = np.nonzero(~np.eye(len(g), dtype=bool))  # ordered pairs: run i's CI, run j's median
        covered = (g.ci_low_s.to_numpy()[i] <= med[j]) & (med[j] <= g.ci_high_s.to_numpy()[i])
        covered_within = drift.covers(g.iloc[i], med[j], 0.0)
        first = g.iloc[0]
        rows.append({**{a: first[a] for a in AXES}, "cell_id": cell_id, "runs": len(g),
                     "median_ms": 1e3 * float(np.median(med)), "max_min": float(med.max() / med.min()),
                     "ci_rel_pct": 100 * float(g.ci_rel.median()), "coverage": float(np.mean(covered)),
                     "coverage_within": float(np.mean(covered_within)),
                     "unstable_runs": int((g.get("stability", pd.Series(dtype=str)).astype(str) == "unstable").sum())})
    cells = pd.DataFrame(rows)
    pairs, agreeing = 0, 0
    for _, conf in ok.groupby(CONFIG, sort=False, dropna=False):  # window is NaN for full attention
        per_run = conf.pivot_table(index="run", columns="impl", values="median_s")
        for a, b in itertools.combinations(per_run.columns, 2):
            signs = np.sign((per_run[a] - per_run[b]).dropna().to_numpy())
            if len(signs) >= 2:
                pairs += 1
                agreeing += bool((signs == signs[0]).all())
    summary = {"cells": len(cells), "worst_max_min": float(cells.max_min.max()) if len(cells) else float("nan"),
               "mean_max_min": float(cells.max_min.mean()) if len(cells) else float("nan"),
               "coverage_pct": 100 * float(cells.coverage.mean()) if len(cells) else float("nan"),
               "coverage_within_pct": 100 * float(cells.coverage_within.mean()) if len(cells) else float("nan"),
               "drift_used": float(ok.drift_rel.max()) if "drift_rel" in ok and ok.drift_rel.notna().any() else 0.0,
               "ranking_agreement_pct": 100 * agreeing / pairs if pairs else float("nan"), "pairs": pairs,
               "unstable_cells": int((cells.unstable_runs > 0).sum()) if len(cells) else 0}
    return cells, summary


def _group_key(cell_id: str) -> str:
    """A cell's comparison group: its ``cell_id`` without the implementation (the ``group_id`` column's rule)."""
    return cell_id.split("|", 1)[1] if "|" in cell_id else cell_id


def _with_speedups(df: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """One run's ok rows with ``group``, ``base`` (the row's baseline, else ``baseline``, else sdpa when swept, else
    the first implementation), ``sp_medians`` (baseline median / median, the unpaired speed-up) and the paired
    ``speedup`` columns (NaN in a run before paired speed-ups)."""
    ok = df[df.status == "ok"].copy()
    for col in ("speedup", "speedup_ci_low", "speedup_ci_high"):
        ok[col] = pd.to_numeric(ok[col], errors="coerce") if col in ok else float("nan")
    ok["group"] = [_group_key(str(c)) for c in ok.cell_id]
    impls = list(dict.fromkeys(ok.impl))
    fallback = baseline or ("sdpa" if "sdpa" in impls else impls[0] if impls else "")
    own = ok["baseline"].astype(object).where(ok["baseline"].notna(), "") if "baseline" in ok else ""
    ok["base"] = [str(b) if b else fallback for b in (own if len(ok) and "baseline" in ok else [""] * len(ok))]
    medians = {(r.impl, r.group): r.median_s for r in ok.itertuples()}
    ok["sp_medians"] = [medians.get((b, g), float("nan")) / m for b, g, m in zip(ok.base, ok.group, ok.median_s,
                                                                                   strict=True)]
    # the unpaired speed-up's 95% half-width (relative): the two medians' CIs (with the between-run term) combined
    rel = {(r.impl, r.group): float(r.ci_rel) for r in ok.itertuples()}
    ok["unpaired_rel"] = [float(np.hypot(rel.get((b, g), float("nan")), r)) for b, g, r in
                          zip(ok.base, ok.group, ok.ci_rel.astype(float), strict=True)]
    ok["paired_rel"] = (ok.speedup_ci_high - ok.speedup_ci_low) / 2 / ok.speedup
    return ok[ok.impl != ok.base]


def speedup_agreement(frames: list[pd.DataFrame], baseline: str | None = None) -> tuple[pd.DataFrame, dict]:
    """Per cell (implementation other than its group's baseline), how its speed-up agrees across runs.

    ``max_min``: max/min of the paired speed-up across runs; ``max_min_medians`` the same for the ratio of
    medians (the unpaired speed-up, measured in separate blocks). ``coverage``: the share of ordered pairs of
    runs (i, j) where run i's paired CI holds run j's speed-up. ``reversed``: some run's CI excludes 1 and
    another run's speed-up is on the other side of 1. Runs without paired speed-ups give only the medians.
    """
    ok = pd.concat([_with_speedups(f, baseline).assign(run=i) for i, f in enumerate(frames)])
    rows = []
    for cell_id, g in ok.groupby("cell_id", sort=False):
        if len(g) < 2:
            continue
        first = g.iloc[0]
        sp, lo, hi = g.speedup.to_numpy(), g.speedup_ci_low.to_numpy(), g.speedup_ci_high.to_numpy()
        paired = bool(np.isfinite(sp).all() and np.isfinite(lo).all() and np.isfinite(hi).all())
        row = {"impl": first.impl, "baseline": first.base, "seq_len": first.seq_len, "mode": first["mode"],
               "dtype": first.dtype, "cell_id": cell_id, "runs": len(g),
               "speedup": float(np.median(sp)) if paired else float("nan"),
               "max_min": float(sp.max() / sp.min()) if paired else float("nan"),
               "max_min_medians": float(np.nanmax(g.sp_medians) / np.nanmin(g.sp_medians)),
               "coverage": float("nan"), "reversed": False, "excludes_1": False,
               "paired_rel": float(np.median(g.paired_rel)), "unpaired_rel": float(np.median(g.unpaired_rel))}
        if paired:
            i, j = np.nonzero(~np.eye(len(g), dtype=bool))
            row["coverage"] = float(np.mean((lo[i] <= sp[j]) & (sp[j] <= hi[i])))
            faster, slower = lo > 1, hi < 1
            row["excludes_1"] = bool((faster | slower).any())
            row["reversed"] = bool((faster.any() and (sp < 1).any()) or (slower.any() and (sp > 1).any()))
        rows.append(row)
    cells = pd.DataFrame(rows, columns=["impl", "baseline", "seq_len", "mode", "dtype", "cell_id", "runs", "speedup",
                                        "max_min", "max_min_medians", "coverage", "reversed", "excludes_1",
                                        "paired_rel", "unpaired_rel"])
    paired_cells = cells[np.isfinite(cells.max_min)] if len(cells) else cells
    nan = float("nan")
    summary = {"speedup_cells": len(cells), "paired_cells": len(paired_cells),
               "speedup_worst_max_min": float(paired_cells.max_min.max()) if len(paired_cells) else nan,
               "speedup_mean_max_min": float(paired_cells.max_min.mean()) if len(paired_cells) else nan,
               "medians_worst_max_min": float(cells.max_min_medians.max()) if len(cells) else nan,
               "medians_mean_max_min": float(cells.max_min_medians.mean()) if len(cells) else nan,
               "speedup_coverage_pct": 100 * float(paired_cells.coverage.mean()) if len(paired_cells) else nan,
               "excluding_1": int(paired_cells.excludes_1.sum()) if len(paired_cells) else 0,
               "reversals": int(paired_cells.reversed.sum()) if len(paired_cells) else 0,
               "paired_half_width": float(paired_cells.paired_rel.median()) if len(paired_cells) else nan,
               "unpaired_half_width": float(paired_cells.unpaired_rel.median()) if len(paired_cells) else nan}
    return cells, summary


def print_speedups(cells: pd.DataFrame, summary: dict) -> None:
    """The speed-up table and its summary line."""
    if len(cells):
        shown = cells[["impl", "baseline", "seq_len", "mode", "speedup", "max_min", "max_min_medians", "coverage",
                       "reversed"]]
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if not summary["paired_cells"]:
        print(f"speed-ups: no paired speed-ups in these runs; the ratio of medians moved by worst "
              f"{summary['medians_worst_max_min']:.3f}, mean {summary['medians_mean_max_min']:.3f}")
        return
    print(f"paired speed-ups across runs: max/min worst {summary['speedup_worst_max_min']:.3f}, mean "
          f"{summary['speedup_mean_max_min']:.3f} (ratio of medians: worst {summary['medians_worst_max_min']:.3f}, mean "
          f"{summary['medians_mean_max_min']:.3f}); a run's paired CI covered another run's speed-up in "
          f"{summary['speedup_coverage_pct']:.0f}% of pairs; {summary['reversals']} of {summary['excluding_1']} "
          "speed-up(s) whose CI excluded 1 in some run reversed in another; median 95% half-width: paired "
          f"±{100 * summary['paired_half_width']:.1f}%, unpaired (the two medians' CIs) "
          f"±{100 * summary['unpaired_half_width']:.1f}%")


def _split_run_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` before ``--`` (this tool's) and after it (passed to every ``attnbench run``)."""
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1:]
    return argv, []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Options after -- go to every `attnbench run` as they are, e.g. "
                                            "-- --target-ci 0.01 --cell-timeout 60.")
    parser.add_argument("--runs", "-k", type=int, default=4, help="independent runs per allocator (default 4)")
    parser.add_argument("--impl", default="weight_split,fused_qkv,einsum,sdpa")
    parser.add_argument("--seq", default="256,512")
    parser.add_argument("--batch", default="2")
    parser.add_argument("--heads", default="4")
    parser.add_argument("--d-model", default="256")
    parser.add_argument("--mode", default="inference")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--budget", type=float, default=1.0, help="sampling seconds per cell and round")
    parser.add_argument("--threads", type=int, help="--threads of each run (default: attnbench run's)")
    parser.add_argument("--device", default="cpu", help="--device of each run (default cpu)")
    parser.add_argument("--drift", help="--drift of each run (default: auto, the calibration or the default)")
    parser.add_argument("--calibrate", action="store_true",
                        help="store the between-run term estimated from these runs as this machine's "
                             f"(file: ${drift.ENV_FILE} or ~/.cache/attnbench/drift.json)")
    parser.add_argument("--cpu-allocator", default="pinned", help="comma-separated; the runs are interleaved")
    parser.add_argument("--keep", metavar="DIR", help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON at the end")
    parser.add_argument("--baseline", help="--baseline of each run: the comparison groups' baseline implementation")
    parser.add_argument("--speedups", action="store_true",
                        help="also report how each speed-up against the baseline agrees across the runs")
    parser.add_argument("--pairs", action="store_true",
                        help="also compare run 1 with run 2, 3 with 4, ... as `attnbench compare` does, and count the "
                             "cells it reads significant (identical code: each one is a false alarm)")
    parser.add_argument("--load", choices=contention_load.KINDS,
                        help="run a contention generator on the spare core during the runs (memory: a copy loop over "
                             "a buffer larger than the LLC, 3 s on / 2 s off; cpu: a busy loop)")
    parser.add_argument("--load-limit", type=float, default=3600.0,
                        help="the generator stops by itself after this many seconds (default 3600); it stops anyway "
                             "when the runs are done or this tool exits")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    own, run_args = _split_run_args(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(own)
    args.run_args = run_args
    if args.runs < 2:
        parser.error("--runs must be at least 2 (agreement needs two runs)")
    if args.calibrate and args.runs < 4:
        parser.error("--calibrate needs --runs 4 or more: the term is the 95th percentile of what reruns differ by, "
                     "and fewer runs would understate it")
    allocators = [a.strip() for a in args.cpu_allocator.split(",") if a.strip()]
    with tempfile.TemporaryDirectory(prefix="attnbench-repro-") as tmp:
        load = contention_load.Load(args.load, args.load_limit) if args.load else None
        dirs = _run_all(args, allocators, Path(args.keep or tmp), load)
        summaries = {allocator: _summarise(args, allocator, dirs[allocator], load) for allocator in allocators}
    if args.json:
        print(json.dumps(summaries))
    return summaries


def _run_all(args, allocators: list[str], out: Path, load) -> dict[str, list[Path]]:
    """``args.runs`` runs per allocator, interleaved, holding the machine's measurement lock (and the load, if any)."""
    dirs: dict[str, list[Path]] = {a: [] for a in allocators}
    with machine_lock.measuring([args.device], purpose=f"attnbench reproducibility: {args.runs} runs"), \
            (load if load is not None else contextlib.nullcontext()):
        if load is not None:
            print(load.describe(), flush=True)
        for k in range(args.runs):
            for allocator in allocators:
                print(f"run {k + 1}/{args.runs} --cpu-allocator {allocator} ...", flush=True)
                dirs[allocator].append(run_once(args, allocator, out / allocator))
    return dirs


def _summarise(args, allocator: str, dirs: list[Path], load) -> dict:
    """One allocator's agreement across its runs, printed; calibrated when ``--calibrate``; the summary."""
    loaded = [load_run(d) for d in dirs]
    frames = [df for df, _ in loaded]
    peaks = [m.get("peak_gflops", {}).get(f"{args.device}/float32") for _, m in loaded]
    peaks = [p for p in peaks if isinstance(p, int | float)]
    cells, summary = agreement(frames)
    summary["drift_estimate"] = drift.estimate(frames)
    print(f"\n--cpu-allocator {allocator}: {args.runs} runs, --rounds {args.rounds}, "
          f"--processes {args.processes}")
    if len(cells):
        shown = cells[["impl", "seq_len", "mode", "median_ms", "max_min", "ci_rel_pct", "coverage",
                       "coverage_within", "unstable_runs"]]
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"max/min of a cell's median across runs: worst {summary['worst_max_min']:.3f}, mean "
          f"{summary['mean_max_min']:.3f}; CI covered another run's median in {summary['coverage_pct']:.0f}% "
          f"of pairs; pairwise rankings agreed in {summary['ranking_agreement_pct']:.0f}% of "
          f"{summary['pairs']} pairs; {summary['unstable_cells']} cell(s) flagged unstable in some run")
    if args.speedups:
        sp_cells, sp_summary = speedup_agreement(frames, args.baseline)
        summary.update(sp_summary)
        print_speedups(sp_cells, sp_summary)
        summary["speedup_run_sd"] = speedup_spread.estimate_run_sd(frames)
        if summary["speedup_run_sd"] is not None:
            print(f"speed-ups' run-level SD estimated from these runs (beyond their rounds' spread): "
                  f"{100 * summary['speedup_run_sd']:.2f}%")
    if args.pairs:
        verdicts = identical_pairs.pair_verdicts(dirs)
        summary["identical_pairs"] = identical_pairs.summarise_pairs(verdicts)
        identical_pairs.print_pairs(verdicts, summary["identical_pairs"])
    if load is not None:
        summary["load"] = load.describe()
    est = summary["drift_estimate"]
    print(f"CIs included a between-run term of ±{100 * summary['drift_used']:.2f}%; the within-run CIs alone "
          f"covered {summary['coverage_within_pct']:.0f}%. Between-run term calibrated on these runs "
          f"(95% of a rerun's medians inside the widened CI): ±{100 * est['rel']:.2f}%")
    if args.calibrate:
        _calibrate(args, allocator, summary, peaks)
    return summary


def _calibrate(args, allocator: str, summary: dict, peaks: list[float]) -> None:
    """Store the between-run term these runs estimate (and the speed-ups' run SD) as this machine's."""
    est = summary["drift_estimate"]
    key = drift.machine_key(parse_device_type(args.device), allocator)
    settings = {"impl": args.impl, "seq": args.seq, "batch": args.batch, "heads": args.heads,
                "d_model": args.d_model, "mode": args.mode, "rounds": args.rounds,
                "processes": args.processes, "threads": args.threads, "device": args.device}
    entry = drift.calibration_entry(est, args.runs, settings, float(np.median(peaks)) if peaks else None)
    if args.speedups and summary.get("speedup_run_sd") is not None:
        entry[speedup_spread.CALIBRATION_KEY] = summary["speedup_run_sd"]
    path = drift.save_calibration(key, entry)
    print(f"calibrated: {key} -> ±{100 * est['rel']:.2f}% in {path}")


if __name__ == "__main__":
    main()
