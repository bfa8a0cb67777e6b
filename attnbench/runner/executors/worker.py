"""``python -m attnbench.runner.executors.worker``: a measuring process that serves cells, one JSON line each.

Started by :class:`attnbench.runner.executors.local.WorkerProcess` with the controlled CPU environment
(:mod:`attnbench.measure.cpu_env`) already in its environment variables, so glibc reads it at exec and
OpenMP when torch loads (importing the package does). It pins glibc's malloc again with ``mallopt``,
starts torch's threads once, says it is ready (with what :func:`~attnbench.measure.cpu_env.describe` found), then answers
each request line on stdin with one line on its protocol pipe:

* ``{"cell": ..., "settings": ..., "run_id": ..., "peak_gflops_per_s": ...}`` -> ``{"row": {...}}`` (:func:`run_cell`'s row plus the
  ``cpu_*`` columns; NaN travels as JSON's ``NaN``);
* ``{"group": [cell, ...], ...}`` (a comparison group, timed in alternation) -> ``{"at": cell_id}`` before each step of
  each member (so the runner can name a member that kills the process), then ``{"rows": [...]}``;
* before measuring a cell or group: ``{"plan": {"timeout_s": ..., "announce": [...]}}``, its timeout in seconds
  (:mod:`attnbench.runner.budget`) and the lines to say for cells predicted to take minutes;
* ``{"probe": true}`` -> ``{"probe": {...}}``: the environment as seen from inside (the OpenMP variables,
  each thread's CPUs, whether a large malloc is mmapped).

Its second argument is the driver's pid: the worker dies with it (:mod:`attnbench.runner.executors.orphans`).
The protocol pipe is the original stdout; fd 1 is pointed at stderr, so whatever an implementation
prints (from Python or C) cannot corrupt it. End of input ends the process (at once, without tearing down
the interpreter).
"""

from __future__ import annotations

import json
import os
import sys


def _serve(label: str, driver_pid: int | None = None) -> None:
    from attnbench.runner.executors.orphans import die_with_parent

    die_with_parent(driver_pid)  # first: nothing may outlive the driver, however it dies
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of implementations go to stderr
    # torch first: OpenMP binds this thread as it loads, so that threads other libraries start later (pyarrow's)
    # inherit that binding rather than every core
    import torch

    from attnbench.measure import cpu_env
    from attnbench.runner.executors.warmup import settle_heap, warm_cells, warm_process

    warm_process(int(os.environ.get("OMP_NUM_THREADS") or 0), pinned=cpu_env.requested_allocator() == "pinned")
    from attnbench import registry
    from attnbench.plugins.exits import plugin_exits
    from attnbench.results.schema import Cell
    from attnbench.runner.group import measure_unit
    from attnbench.runner.sweep import Settings

    described = cpu_env.describe()
    worker = f"{label} pid{os.getpid()}"

    def send(message: dict) -> None:
        proto.write(json.dumps(message) + "\n")

    send({"ready": {**described, "pid": os.getpid(), "threads": torch.get_num_threads(), "names": registry.names()}})
    settle_heap()  # what the imports and the warm-up made lives as long as the process (after the answer: off
    # the driver's wait when it is not waiting yet)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("probe"):
            send({"probe": {**described, "threads": torch.get_num_threads(),
                            "thread_cpus": cpu_env.thread_affinities(),
                            "large_malloc_mmapped": cpu_env.large_malloc_is_mmapped(),
                            "env": {k: os.environ.get(k) for k in (*cpu_env.OMP_BINDING, "OMP_NUM_THREADS",
                                                                   "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                                                   "LD_PRELOAD")}}})
            continue
        peak = request.get("peak_gflops_per_s")
        if "group" in request:  # a comparison group, timed in alternation; progress before each member's steps
            cells = [Cell(**c) for c in request["group"]]
            warm_cells(cells, peak_known=peak is not None)
            with plugin_exits():  # a plug-in's sys.exit/os._exit is the cell's error, not the worker's death
                rows = measure_unit(cells, Settings(**request["settings"]), request["run_id"], peak_gflops_per_s=peak,
                                    on_member=lambda cell_id: send({"at": cell_id}),
                                    on_plan=lambda plan: send({"plan": plan}))
            for row in rows:
                row.update(described, worker=worker)
            send({"rows": rows})
            settle_heap()  # after the answer: modules a group imported (Inductor's) are not walked again
            continue
        cell = Cell(**request["cell"])
        warm_cells([cell], peak_known=peak is not None)
        with plugin_exits():
            (row,) = measure_unit([cell], Settings(**request["settings"]), request["run_id"], peak_gflops_per_s=peak,
                                  on_plan=lambda plan: send({"plan": plan}))
        row.update(described, worker=worker)
        send({"row": row})
        settle_heap()


def _leave() -> None:
    """End the process at once: everything was answered, and tearing down an interpreter that holds torch and
    Inductor (freeing every module and object) would keep the driver waiting for a second or more. Of that teardown
    only ending Inductor's compile workers matters (they would otherwise notice within a minute)."""
    compiling = sys.modules.get("torch._inductor.async_compile")
    if compiling is not None:
        compiling.shutdown_compile_workers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1] if len(sys.argv) > 1 else "worker",
           int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else None)
    _leave()
