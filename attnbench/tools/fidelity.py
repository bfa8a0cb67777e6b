"""Fidelity benchmark: attnbench's timing primitive against ``torch.utils.benchmark`` on the same workloads.

Run it as a script (it is a benchmark, not a unit test)::

    python -m attnbench.tools.fidelity [--budget 1.0] [--repeats 3]

For each workload both timers measure the same ``Workload.step`` in one process, alternating which
goes first, and the ratio of medians (attnbench / blocked_autorange) is printed with its spread over
repeats. Both use the same number of threads, and both measure under the CPU environment of
``attnbench run`` (:mod:`attnbench.measure.cpu_env`): the script runs itself in a process started with
it (``--cpu-allocator``, default ``pinned``). It measures under the machine's measurement lock
(:mod:`attnbench.measure.machine_lock`): another attnbench measurement finishes first.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import torch
from torch.utils import benchmark

from attnbench.measure import machine_lock, time_fn
from attnbench.results.schema import Cell
from attnbench.runner.workload import build_workload

WORKLOADS = [
    Cell("weight_split", batch=2, seq_len=128, num_heads=4, d_model=256, mode="forward"),
    Cell("weight_split", batch=2, seq_len=512, num_heads=4, d_model=256, mode="forward"),
    Cell("sdpa", batch=2, seq_len=512, num_heads=4, d_model=256, mode="forward"),
    Cell("fused_qkv", batch=2, seq_len=256, num_heads=4, d_model=256, mode="inference"),
    Cell("sdpa", batch=2, seq_len=256, num_heads=4, d_model=256, mode="forward+backward"),
    Cell("wrapper", batch=1, seq_len=64, num_heads=4, d_model=128, mode="inference"),
]


def measure(cell: Cell, budget_s: float, repeats: int) -> dict:
    """Medians of both timers over ``repeats`` alternating rounds, and their ratios."""
    w = build_workload(cell)
    timer = benchmark.Timer(stmt="step()", globals={"step": w.step}, num_threads=torch.get_num_threads())
    ours, theirs = [], []
    for i in range(repeats):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                ours.append(time_fn(w.step, w.device, budget_s=budget_s, target_rel_ci=0.0).stats()["median_s"])
            else:
                theirs.append(timer.blocked_autorange(min_run_time=budget_s).median)
    ratios = [a / b for a, b in zip(ours, theirs, strict=False)]
    return {"cell": cell.cell_id, "attnbench_ms": 1e3 * statistics.median(ours),
            "torch_benchmark_ms": 1e3 * statistics.median(theirs), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per measurement for each timer")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per workload")
    parser.add_argument("--cpu-allocator", default="pinned", help="the measuring environment (as attnbench run's)")
    parser.add_argument("--no-cpu-bind", action="store_true", help="no OpenMP binding (as attnbench run's)")
    args = parser.parse_args(argv)
    from attnbench.measure import cpu_env

    if cpu_env.requested_allocator() is None:  # not yet in the measuring environment: start in it
        env = cpu_env.process_env(cpu_env.CpuEnv(cpu_env.check_allocator(args.cpu_allocator), not args.no_cpu_bind))
        raise SystemExit(subprocess.run([sys.executable, "-m", "attnbench.tools.fidelity",
                                         *(argv if argv is not None else sys.argv[1:])], env=env).returncode)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, budget {args.budget}s, {args.repeats} rounds")
    print(f"{'workload':58} {'attnbench':>11} {'blocked_autorange':>18} {'ratio':>7}  range")
    worst = 0.0
    with machine_lock.measuring(["cpu"], purpose="attnbench fidelity benchmark"):
        for cell in WORKLOADS:
            r = measure(cell, args.budget, args.repeats)
            worst = max(worst, abs(r["ratio"] - 1))
            print(f"{r['cell']:58} {r['attnbench_ms']:9.3f}ms {r['torch_benchmark_ms']:16.3f}ms {r['ratio']:7.3f}"
                  f"  {r['ratio_min']:.3f}-{r['ratio_max']:.3f}")
    print(f"largest deviation of the median ratio from 1: {100 * worst:.1f}%")
    from attnbench.measure import cpu_env

    print(f"measured under {cpu_env.describe()}")


if __name__ == "__main__":
    main()
