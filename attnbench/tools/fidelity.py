"""Fidelity benchmark: attnbench's timing primitive against ``torch.utils.benchmark`` on the same workloads.

Run it as a script (it is a benchmark, not a unit test)::

    python -m attnbench.tools.fidelity [--budget 1.0] [--repeats 3]

For each workload both timers measure the same ``Workload.step`` in one process, alternating which
goes first, and the ratio of medians (attnbench / blocked_autorange) is printed with its spread over
repeats. Both use the same number of threads, and both measure under the CPU environment of
``attnbench run`` (:mod:`attnbench.measure.cpu_env`): the script runs itself in a process started with
it (``--cpu-allocator``, default ``pinned``). It measures under the machine's measurement lock
(:mod:`attnbench.measure.machine_lock`): another attnbench measurement finishes first.

``--paired`` checks the interleaved path of comparison groups instead (:func:`measure_pair`): for each pair of
:data:`PAIRS`, attnbench's paired speed-up (the two members timed in alternating bursts,
:func:`attnbench.measure.interleave.time_interleaved`, as ``attnbench run`` times a group) against
``blocked_autorange``'s ratio of medians (each member timed alone, alternating which goes first), and each member's
interleaved median against its ``blocked_autorange`` median. Where they differ, the bursts are why: a member's burst
starts after the other member's, whose working set and freed buffers it inherits (L2, the allocator), and its first
calls pay for that; ``blocked_autorange`` times each member in one warm block.
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
from attnbench.runner.sweep import Settings
from attnbench.runner.workload import build_workload

WORKLOADS = [
    Cell("weight_split", batch=2, seq_len=128, num_heads=4, d_model=256, mode="forward"),
    Cell("weight_split", batch=2, seq_len=512, num_heads=4, d_model=256, mode="forward"),
    Cell("sdpa", batch=2, seq_len=512, num_heads=4, d_model=256, mode="forward"),
    Cell("fused_qkv", batch=2, seq_len=256, num_heads=4, d_model=256, mode="inference"),
    Cell("sdpa", batch=2, seq_len=256, num_heads=4, d_model=256, mode="forward+backward"),
    Cell("wrapper", batch=1, seq_len=64, num_heads=4, d_model=128, mode="inference"),
]


PAIRS = [
    (Cell("sdpa", batch=2, seq_len=256, num_heads=4, d_model=256, mode="forward"),
     Cell("weight_split", batch=2, seq_len=256, num_heads=4, d_model=256, mode="forward")),
    (Cell("sdpa", batch=2, seq_len=512, num_heads=4, d_model=256, mode="inference"),
     Cell("fused_qkv", batch=2, seq_len=512, num_heads=4, d_model=256, mode="inference")),
    (Cell("sdpa", batch=2, seq_len=64, num_heads=4, d_model=256, mode="forward+backward"),
     Cell("einsum", batch=2, seq_len=64, num_heads=4, d_model=256, mode="forward+backward")),
]
"""Baseline and member of the ``--paired`` check: shapes of the default sweep, one per mode."""


def measure_pair(base: Cell, member: Cell, budget_s: float, repeats: int) -> dict:
    """Over ``repeats`` alternating rounds: attnbench's paired speed-up of ``member`` against ``base`` (interleaved
    bursts for ``2 * budget_s``) and ``blocked_autorange``'s ratio of medians; both members' interleaved medians
    against their ``blocked_autorange`` medians. Medians over the rounds, and the ratios' ranges."""
    from attnbench.measure.interleave import time_interleaved

    steps = {"base": build_workload(base).step, "member": build_workload(member).step}
    timers = {k: benchmark.Timer(stmt="step()", globals={"step": f}, num_threads=torch.get_num_threads())
              for k, f in steps.items()}
    ours, theirs, med_ratio = [], [], {"base": [], "member": []}
    for i in range(repeats):
        tub = {}
        for which in (("paired", "tub") if i % 2 == 0 else ("tub", "paired")):
            if which == "paired":
                t = time_interleaved(steps, budget_s=2 * budget_s, target_rel_ci=0.0, baseline="base", seed=i,
                                     pairing=Settings().pairing)  # as attnbench run pairs a group's bursts
                ours.append(t.speedup("member")[0])
                medians = {k: t.stats(k)["median_s"] for k in steps}
            else:
                for k in (("base", "member") if i % 2 == 0 else ("member", "base")):
                    tub[k] = timers[k].blocked_autorange(min_run_time=budget_s).median
        theirs.append(tub["base"] / tub["member"])
        for k in steps:
            med_ratio[k].append(medians[k] / tub[k])
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"pair": f"{member.impl} vs {base.impl} {member.group_id}", "paired": statistics.median(ours),
            "tub_ratio": statistics.median(theirs), "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "base_median_ratio": statistics.median(med_ratio["base"]),
            "member_median_ratio": statistics.median(med_ratio["member"])}


def main_paired(budget_s: float, repeats: int) -> float:
    """Print the ``--paired`` table; the largest deviation of a speed-up ratio from 1."""
    print(f"{'pair':70} {'paired':>7} {'TUB':>7} {'ratio':>7}  range        medians/TUB (base, member)")
    worst = 0.0
    for base, member in PAIRS:
        r = measure_pair(base, member, budget_s, repeats)
        worst = max(worst, abs(r["ratio"] - 1))
        print(f"{r['pair']:70} {r['paired']:7.3f} {r['tub_ratio']:7.3f} {r['ratio']:7.3f}  {r['ratio_min']:.3f}-"
              f"{r['ratio_max']:.3f}  {r['base_median_ratio']:.3f}, {r['member_median_ratio']:.3f}")
    print(f"largest deviation of the paired speed-up from blocked_autorange's ratio of medians: {100 * worst:.1f}%")
    return worst


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
    parser.add_argument("--budget", type=float, default=0.2,
                        help="seconds per measurement for each timer (default 0.2: blocked_autorange's min_run_time in "
                             "the issue's reference)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="alternating rounds per workload (default 15): the ratio of each round's two medians, "
                             "measured moments apart, then the median over rounds; on a VM whose speed changes every "
                             "50-500 ms, many short rounds pair the two timers more closely than a few long ones")
    parser.add_argument("--cpu-allocator", default="pinned", help="the measuring environment (as attnbench run's)")
    parser.add_argument("--no-cpu-bind", action="store_true", help="no OpenMP binding (as attnbench run's)")
    parser.add_argument("--threads", type=int, help="intra-op threads of both timers (default: attnbench run's, every "
                                                    "usable core but one under the controlled environment)")
    parser.add_argument("--paired", action="store_true", help="the interleaved path: paired speed-ups of comparison "
                        "groups against blocked_autorange's ratio of medians")
    args = parser.parse_args(argv)
    from attnbench.measure import cpu_env

    if cpu_env.requested_allocator() is None:  # not yet in the measuring environment: start in it
        bind = not args.no_cpu_bind
        env = cpu_env.process_env(cpu_env.CpuEnv(cpu_env.check_allocator(args.cpu_allocator), bind,
                                                 cpu_env.measuring_threads(args.threads, bind)))
        raise SystemExit(subprocess.run([sys.executable, "-m", "attnbench.tools.fidelity",
                                         *(argv if argv is not None else sys.argv[1:])], env=env).returncode)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, budget {args.budget}s, {args.repeats} rounds")
    print(f"{'workload':58} {'attnbench':>11} {'blocked_autorange':>18} {'ratio':>7}  range")
    worst = 0.0
    with machine_lock.measuring(["cpu"], purpose="attnbench fidelity benchmark"):
        if args.paired:
            main_paired(args.budget, args.repeats)
        for cell in [] if args.paired else WORKLOADS:
            r = measure(cell, args.budget, args.repeats)
            worst = max(worst, abs(r["ratio"] - 1))
            print(f"{r['cell']:58} {r['attnbench_ms']:9.3f}ms {r['torch_benchmark_ms']:16.3f}ms {r['ratio']:7.3f}"
                  f"  {r['ratio_min']:.3f}-{r['ratio_max']:.3f}")
    if not args.paired:
        print(f"largest deviation of the median ratio from 1: {100 * worst:.1f}%")

    print(f"measured under {cpu_env.describe()}")


if __name__ == "__main__":
    main()
