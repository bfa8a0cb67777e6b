"""The process that :mod:`attnbench.measure.instructions` runs under valgrind's callgrind to count one cell.

``python -m attnbench.measure.callgrind_worker SPEC.json`` (started by :func:`attnbench.measure.instructions.count_cell`,
never by hand): it builds the cell's :class:`~attnbench.runner.workload.Workload` natively fast (valgrind runs with
``--instr-atstart=no``, so the imports and the build are not instrumented), calls it ``warmup`` times, switches
callgrind's instrumentation on (``callgrind_control -i on``: the same request ``--instr-atstart=yes`` would make, but
only now), then collects two parts with PyTorch's own callgrind client requests (``torch._C._valgrind_toggle`` and
``_valgrind_toggle_and_dump_stats``, which ``torch.utils.benchmark.Timer.collect_callgrind`` uses too):

1. ``calls`` calls of the cell's step in a plain loop, ``repeats`` times, each its own part (callgrind's output
   file parts 1 to ``repeats``): the repeats' spread is the count's noise (issue 45);
2. the same loop calling a function that does nothing (the last part): the harness's own instructions per call.

It writes what it knows beside the counts (``SPEC.result.json``): the vector ISA PyTorch's CPU kernels chose, the
threads, and the wall time of each part (for the slowdown of a counted call against a timed one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _instrumentation_on() -> float:
    """Ask callgrind to instrument from here on; keep running Python until it did (a process blocked in a system
    call would need ptrace to be reached). Seconds it took."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(["callgrind_control", "--instr=on", str(os.getpid())], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    spins = 0
    while proc.poll() is None:  # running bytecode: callgrind polls for the request between basic blocks
        spins += 1
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"callgrind_control --instr=on failed (exit {proc.returncode}): {out.strip()[:300]}; "
                           "is this process running under valgrind --tool=callgrind?")
    return time.perf_counter() - t0


def _counted(fn, calls: int) -> float:
    """``calls`` calls of ``fn`` with callgrind collecting, dumped as one part; the loop's wall seconds."""
    import torch

    loop = range(calls)
    torch._C._valgrind_toggle()
    t0 = time.perf_counter()
    for _ in loop:
        fn()
    seconds = time.perf_counter() - t0
    torch._C._valgrind_toggle_and_dump_stats()
    return seconds


def _nothing() -> None:
    """The harness baseline's call: the loop and a Python call, no work."""


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    from attnbench.measure.cpu_env import pin_glibc_malloc
    from attnbench.results.schema import Cell
    from attnbench.runner.workload import build_workload

    pinned = pin_glibc_malloc()
    cell = Cell(**spec["cell"])
    t0 = time.perf_counter()
    workload = build_workload(cell, seed=int(spec.get("seed", 0)))
    step = workload.step
    for _ in range(max(int(spec["warmup"]), 1)):  # the first call (lazy init, kernel choice) is never counted
        step()
    build_s = time.perf_counter() - t0
    on_s = _instrumentation_on()
    step_s = sum(_counted(step, int(spec["calls"])) for _ in range(max(int(spec.get("repeats", 1)), 1)))
    base_s = _counted(_nothing, int(spec["calls"]))
    result = dict(capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                  build_s=build_s, instrument_s=on_s, step_s=step_s, baseline_s=base_s, malloc_pinned=pinned,
                  notes=list(workload.notes))
    Path(spec_path).with_suffix(".result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
