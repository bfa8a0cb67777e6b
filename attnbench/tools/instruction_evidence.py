"""The evidence behind the instruction-count gate (docs/instructions.md), measured by you, never in the test suite.

``python -m attnbench.tools.instruction_evidence spread --impl sdpa --runs 10 [--load memory]``
    counts one cell ``--runs`` times, each in a fresh valgrind process, and prints the spread
    ((max - min) / median) of the instructions per call, optionally with the spare core loaded by
    :mod:`attnbench.tools.load` (a memory-bandwidth hog);
``python -m attnbench.tools.instruction_evidence gate --runs 10 [--load memory]``
    the gate's decisions: ``--runs`` counts of ``weight_split`` and of the planted regression
    (``examples/planted_regression.py``: the same output with extra elementwise passes; ``--planted PlantedOnePass``
    for one), alternated; each planted count is compared with an unchanged one (must fail) and each unchanged count
    with the next unchanged one (must pass), at each pair's noise threshold (``--threshold`` fixes one).

``python -m attnbench.tools.instruction_evidence walltime --impl sdpa``
    times the cell natively in a process with the count's environment (one thread, the same ISA limit): the
    other side of the slowdown of a counted call, and of how counts and times move together.

``--json FILE`` writes every count (and its wall time) for the record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from attnbench.measure.instructions import CountSettings, count_cell, count_env
from attnbench.results.compare_instructions import DEFAULT_THRESHOLD, cell_threshold
from attnbench.results.schema import Cell
from attnbench.tools.load import Load

PLANTED = "weight_split={}:{}"


def planted_impl(cls: str = "PlantedWeightSplit") -> str:
    """The planted regression ``cls`` under weight_split's name (the example file of the source tree):
    ``PlantedWeightSplit`` (about +1.1% instructions per call) or ``PlantedOnePass`` (about a third of that)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "planted_regression.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: the gate evidence needs a source checkout of attnbench")
    return PLANTED.format(path, cls)


def _cell(impl: str, args) -> Cell:
    return Cell(impl=impl, batch=args.batch, seq_len=args.seq, num_heads=args.heads, d_model=args.d_model, mode=args.mode)


def _count(impl: str, args, settings: CountSettings) -> dict:
    t0 = time.perf_counter()
    row = count_cell(_cell(impl, args), settings)
    out = dict(impl=impl, instructions=row["instructions"], baseline=row["instructions_baseline"],
               spread=row.get("instr_spread", float("nan")),
               count_s=time.perf_counter() - t0, call_s=row["instr_call_s"], capability=row["cpu_capability"])
    print(f"  {impl.split('=')[0]}{' (planted)' if 'Planted' in impl else ''}: {out['instructions']:,.1f} "
          f"instructions/call, spread {100 * out['spread']:.4f}% ({out['count_s']:.0f} s)", flush=True)
    return out


def _counts(impls: list[str], args, settings: CountSettings) -> list[dict]:
    """One count per entry of ``impls``, ``--jobs`` at a time (a count does not change with the load, so counting
    several at once changes only how long the evidence takes)."""
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(lambda impl: _count(impl, args, settings), impls))


def spread(args, settings: CountSettings) -> dict:
    counts = _counts([args.impl] * args.runs, args, settings)
    values = [c["instructions"] for c in counts]
    median = statistics.median(values)
    result = dict(kind="spread", impl=args.impl, runs=len(values), median=median, min=min(values), max=max(values),
                  spread_rel=(max(values) - min(values)) / median, counts=counts)
    print(f"{args.impl}: median {median:,.1f}, min {min(values):,.1f}, max {max(values):,.1f}, "
          f"spread {100 * result['spread_rel']:.5f}% over {len(values)} runs")
    return result


def gate(args, settings: CountSettings) -> dict:
    """``--runs`` counts of weight_split and of the planted class, alternated. Each planted count is compared with an
    unchanged one (must fail), each unchanged count with the next unchanged one (must pass), at ``--threshold`` or,
    without it, at each pair's threshold from its two recorded spreads, as ``attnbench compare`` sets it."""
    planted = planted_impl(args.planted)
    both = _counts(["weight_split", planted] * args.runs, args, settings)  # alternated
    base, bad = both[0::2], both[1::2]

    def limit(a: dict, b: dict) -> float:
        return args.threshold if args.threshold is not None else cell_threshold(a["spread"], b["spread"])[0]

    caught = [b["instructions"] / a["instructions"] > 1 + limit(a, b) for a, b in zip(base, bad, strict=True)]
    nxt = [base[(i + 1) % len(base)] for i in range(len(base))]
    passed = [b["instructions"] / a["instructions"] <= 1 + limit(a, b) for a, b in zip(base, nxt, strict=True)]
    extra = statistics.median(b["instructions"] / a["instructions"] - 1 for a, b in zip(base, bad, strict=True))
    limits = sorted(limit(a, b) for a, b in zip(base, bad, strict=True))
    how = f"{100 * args.threshold:g}%" if args.threshold is not None else \
        f"each pair's noise threshold ({100 * limits[0]:.3f}% to {100 * limits[-1]:.3f}%)"
    print(f"planted regression ({args.planted}): +{100 * extra:.3f}% instructions (median); caught "
          f"{sum(caught)}/{len(caught)} at {how}; unchanged passed {sum(passed)}/{len(passed)}")
    return dict(kind="gate", planted_class=args.planted, threshold=args.threshold, thresholds=limits, extra_rel=extra,
                caught=sum(caught), passed=sum(passed), runs=args.runs, unchanged=base, planted=bad)


def walltime(args, settings: CountSettings) -> dict:
    """The cell timed natively (``attnbench.measure.time_fn``) in a process with the count's environment (one thread,
    the same ISA limit), for the slowdown of a counted call and for how counts and times move together."""
    env = count_env(settings)
    code = ("import json, sys, torch; torch.set_num_threads(1); from attnbench.measure import time_fn; "
            "from attnbench.results.schema import Cell; from attnbench.runner.workload import build_workload; "
            "c = Cell(**json.loads(sys.argv[1])); w = build_workload(c); w.step(); "
            "t = time_fn(w.step, w.device, warmup_calls=3, budget_s=2.0, min_samples=20, target_rel_ci=0.01); "
            "s = t.stats(); print(json.dumps(dict(median_s=s['median_s'], min_s=s['min_s'], n=s['n'], "
            "capability=torch.backends.cpu.get_cpu_capability())))")
    cell = _cell(args.impl, args)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(cell))], env=env, capture_output=True, text=True,
                         check=True)
    result = dict(kind="walltime", impl=args.impl, cell=cell.cell_id, **json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{cell.cell_id}: median {result['median_s'] * 1e6:.1f} us, min {result['min_s'] * 1e6:.1f} us "
          f"({result['n']} samples, {result['capability']})")
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnbench.tools.instruction_evidence", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("spread", "gate", "walltime"))
    p.add_argument("--impl", default="sdpa", help="spread: the implementation counted (default sdpa)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--load", choices=("memory", "cpu"), help="load the spare core while counting")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-model", dest="d_model", type=int, default=256)
    p.add_argument("--mode", default="inference")
    p.add_argument("--threshold", type=float, default=None, help="gate: a fixed relative threshold (e.g. "
                   f"{DEFAULT_THRESHOLD}); default: each pair's, from its spreads, as attnbench compare sets it")
    p.add_argument("--planted", default="PlantedWeightSplit", choices=("PlantedWeightSplit", "PlantedOnePass"),
                   help="gate: the planted class of examples/planted_regression.py")
    p.add_argument("--json", type=Path, help="write the counts here")
    p.add_argument("--jobs", type=int, default=1, help="counts at once (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = CountSettings()
    load = Load(args.load, seconds=24 * 3600).start() if args.load else None
    try:
        if load:
            print(load.describe(), flush=True)
        result = {"spread": spread, "gate": gate, "walltime": walltime}[args.what](args, settings)
    finally:
        if load:
            load.stop()
    result["load"] = args.load or "none"
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
