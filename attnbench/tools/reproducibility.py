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
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from attnbench.devices import parse_device_type
from attnbench.measure import drift, machine_lock
from attnbench.results.schema import AXES
from attnbench.results.store import load_run

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
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2 (agreement needs two runs)")
    if args.calibrate and args.runs < 4:
        parser.error("--calibrate needs --runs 4 or more: the term is the 95th percentile of what reruns differ by, "
                     "and fewer runs would understate it")
    allocators = [a.strip() for a in args.cpu_allocator.split(",") if a.strip()]
    with tempfile.TemporaryDirectory(prefix="attnbench-repro-") as tmp:
        out = Path(args.keep or tmp)
        dirs: dict[str, list[Path]] = {a: [] for a in allocators}
        with machine_lock.measuring([args.device], purpose=f"attnbench reproducibility: {args.runs} runs"):
            for k in range(args.runs):
                for allocator in allocators:
                    print(f"run {k + 1}/{args.runs} --cpu-allocator {allocator} ...", flush=True)
                    dirs[allocator].append(run_once(args, allocator, out / allocator))
        summaries = {}
        for allocator in allocators:
            loaded = [load_run(d) for d in dirs[allocator]]
            frames = [df for df, _ in loaded]
            peaks = [m.get("peak_gflops", {}).get(f"{args.device}/float32") for _, m in loaded]
            peaks = [p for p in peaks if isinstance(p, int | float)]
            cells, summary = agreement(frames)
            summary["drift_estimate"] = drift.estimate(frames)
            summaries[allocator] = summary
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
            est = summary["drift_estimate"]
            print(f"CIs included a between-run term of ±{100 * summary['drift_used']:.2f}%; the within-run CIs alone "
                  f"covered {summary['coverage_within_pct']:.0f}%. Between-run term calibrated on these runs "
                  f"(95% of a rerun's medians inside the widened CI): ±{100 * est['rel']:.2f}%")
            if args.calibrate:
                device_type = parse_device_type(args.device)
                key = drift.machine_key(device_type, allocator)
                settings = {"impl": args.impl, "seq": args.seq, "batch": args.batch, "heads": args.heads,
                            "d_model": args.d_model, "mode": args.mode, "rounds": args.rounds,
                            "processes": args.processes, "threads": args.threads, "device": args.device}
                peak = float(np.median(peaks)) if peaks else None
                path = drift.save_calibration(key, drift.calibration_entry(est, args.runs, settings, peak))
                print(f"calibrated: {key} -> ±{100 * est['rel']:.2f}% in {path}")
    if args.json:
        print(json.dumps(summaries))
    return summaries


if __name__ == "__main__":
    main()
