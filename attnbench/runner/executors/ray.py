"""Run a sweep's cells as Ray tasks: on a private Ray instance on this machine, or across a Ray cluster.

``RayExecutor`` has the interface of every executor (:mod:`attnbench.runner.executors.base`), so
the runner stores each row as soon as its cell finishes, wherever it ran. Each work unit (a comparison
group, or one cell) is one task that holds its device exclusively, so no two timed cells ever share one:

* a CPU cell needs all of the custom resource ``attnbench_cpu_slot`` of its node; each node
  advertises exactly one (``ray start --resources='{"attnbench_cpu_slot": 1}'``; the local instance
  this module starts does it itself), so one CPU cell at a time runs on a node, with all its cores;
* a CUDA cell needs one GPU (``num_gpus=1``; Ray sets ``CUDA_VISIBLE_DEVICES``, and the worker
  process exits after the cell, so every CUDA cell starts with a fresh CUDA context) plus a sliver
  (``GPU_CELL_SLOT``) of the same slot: cells on different GPUs of a node run side by side, but a
  CPU cell, which needs the whole slot and all the cores, never runs next to a timed GPU cell.

A custom resource rather than ``num_cpus=<all CPUs of the node>`` because nodes differ in CPU count
and a task's request is the same on every node; the slot says "this node's host" whatever its size.

Same outcomes as a local run: ``attnbench.runner.cell.run_cell`` runs in the worker's main thread (checked:
Ray runs tasks there), so its alarm turns a Python-level hang into a ``timeout`` row; a cell stuck in
native code past ``cell_timeout_s + kill_grace_s`` is force-cancelled from the driver (its worker
killed) and recorded as ``timeout``; a worker that dies (segfault, abort, ``os._exit``) gives an
``error`` row naming the death, one that Ray's memory monitor kills an ``oom`` row, and the sweep goes
on. A cell lost with its node is resubmitted once (the row's ``notes`` say so). Ctrl-C cancels every
outstanding task and re-raises, so the runner keeps the finished rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

# Ray first: without it, this ImportError is what the runner turns into "pip install 'attnbench[ray]'".
import ray
import ray.exceptions

from attnbench.errors import AttnbenchError
from attnbench.measure import cpu_env
from attnbench.results.schema import Cell, failed_row
from attnbench.runner.executors.base import OnRow, OnStart, WorkUnit
from attnbench.runner.sweep import Settings

CPU_SLOT = "attnbench_cpu_slot"
"""The custom resource every node advertises exactly once; a CPU cell takes all of it."""
GPU_CELL_SLOT = 0.001
"""A CUDA cell's share of its node's slot: keeps CPU cells off a node while its GPUs are timed."""
KILL_GRACE_S = 10.0
"""Seconds past ``cell_timeout_s`` after which the driver kills a cell that its own alarm did not stop."""
POLL_S = 1.0
"""Longest wait for a result before checking deadlines (and letting Ctrl-C through)."""

_RESUBMIT = (ray.exceptions.NodeDiedError, ray.exceptions.LocalRayletDiedError, ray.exceptions.ObjectLostError,
             ray.exceptions.RaySystemError)
"""Failures of the cluster rather than of the cell: the cell is submitted once more."""


# ---------------------------------------------------------------------------------------------------
# Starting or joining Ray


def _ray_constants():
    """Ray's ``ray._private.ray_constants`` module, or None when this Ray has moved it.

    Private API, used only here: without it the environment variable alone still applies to a Ray
    imported later (the flag is read once at import), so the fallback is the variable.
    """
    try:
        from ray._private import ray_constants
    except ImportError:
        return None
    return ray_constants


@contextlib.contextmanager
def _loopback_only():
    """While starting a local instance, have Ray use 127.0.0.1 and listen on loopback only.

    On Linux Ray replaces a node address of 127.0.0.1 by the machine's routable address and binds
    some servers to all interfaces. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's single-machine
    mode (the default on macOS and Windows): node address 127.0.0.1, every server on loopback. The
    flag is read once at import, so the module constant is switched as well; both are restored after.
    """
    ray_constants = _ray_constants()
    saved_env = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")}
    saved_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a private instance does not report usage
    if saved_flag is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag


def start_local(num_cpus: int | None = None, num_gpus: int | None = None, **init_kwargs):
    """Start a private Ray instance on this machine for attnbench and connect to it.

    It listens on 127.0.0.1 only, has no dashboard, does not report usage statistics, and advertises
    one ``attnbench_cpu_slot``; ``num_cpus`` defaults to every CPU here, GPUs are detected by Ray.
    Stop it with ``ray.shutdown()``.
    """
    with _loopback_only():
        return ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, num_gpus=num_gpus,
                        resources={CPU_SLOT: 1}, include_dashboard=False, _node_ip_address="127.0.0.1",
                        **init_kwargs)


def _client_mode() -> bool:
    """True when connected through Ray Client (``ray://``), which has no streaming generators."""
    try:
        from ray.util.client import ray as client_ray

        return bool(client_ray.is_connected())
    except Exception:
        return False


def check_resources(cells: Iterable[Cell], nodes: list[dict]) -> None:
    """Raise :class:`AttnbenchError` when no alive node can run some of ``cells`` (they would wait forever),
    or when a node advertises more than one CPU slot (two CPU cells would share its cores)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    res = [n.get("Resources", {}) for n in alive]
    cells = list(cells)
    how = (f"start each node with `ray start ... --resources='{{\"{CPU_SLOT}\": 1}}'` "
           "(see docs/ray.md)")
    crowded = [(n.get("NodeManagerAddress", "?"), r[CPU_SLOT]) for n, r in zip(alive, res, strict=True)
               if r.get(CPU_SLOT, 0) > 1]
    if crowded:
        addr, slots = crowded[0]
        raise AttnbenchError(f"Ray node {addr} advertises {slots:g} {CPU_SLOT}; each node must advertise exactly 1, "
                             "or CPU cells would share its cores and time each other")
    if any(not c.device.startswith("cuda") for c in cells) and not any(r.get(CPU_SLOT, 0) >= 1 for r in res):
        raise AttnbenchError(f"no node of the Ray cluster advertises the resource {CPU_SLOT!r}, which CPU cells "
                             f"need; {how}")
    if any(c.device.startswith("cuda") for c in cells) and not any(
            r.get("GPU", 0) >= 1 and r.get(CPU_SLOT, 0) >= GPU_CELL_SLOT for r in res):
        has_gpu = any(r.get("GPU", 0) >= 1 for r in res)
        raise AttnbenchError("the sweep has CUDA cells but no node of the Ray cluster has "
                             + (f"both a GPU and the resource {CPU_SLOT!r}; {how}" if has_gpu else "a GPU"))


# ---------------------------------------------------------------------------------------------------
# In the worker

_NODE_ENV: dict | None = None


def _prepare(cells: tuple[Cell, ...], settings: Settings, driver_cwd: str) -> dict:
    """Set up this worker like a local run and say where the unit runs (sent to the driver first)."""
    global _NODE_ENV
    if driver_cwd and os.path.isdir(driver_cwd):
        os.chdir(driver_cwd)  # relative plug-in paths resolve as on the driver, where that folder exists here
    from attnbench.runner.executors.warmup import warm_cells, warm_process

    # The same warm-up as a local worker, before the start is reported (the driver's clock for killing a stuck
    # cell starts then) and outside the cell's own alarm: --threads, else every usable core of this node but one.
    warm_process(cpu_env.measuring_threads(settings.threads, settings.cpu_bind), pinned=settings.cpu_allocator == "pinned")
    warm_cells(cells)
    node_id = ray.get_runtime_context().get_node_id()
    gpus = [str(g) for g in ray.get_gpu_ids()] if cells[0].device.startswith("cuda") else []
    if _NODE_ENV is None:
        from attnbench import environment

        env = environment.collect([])
        env.pop("command", None)
        env.update(ray_node_id=node_id, ray_node_ip=ray.util.get_node_ip_address(), ray_version=ray.__version__)
        _NODE_ENV = env
    worker = f"ray:{node_id[:8]}" + (f" gpu{','.join(gpus)}" if gpus else "") + f" pid{os.getpid()}"
    return {"node_id": node_id, "host": socket.gethostname(), "worker": worker, "gpus": gpus, "env": _NODE_ENV,
            "started_at": datetime.now(UTC).isoformat(timespec="microseconds")}


def _measure(cells: tuple[Cell, ...], settings: Settings, run_id: str, info: dict) -> list[dict]:
    """The rows of a unit measured in this Ray worker (one cell, or a comparison group timed in alternation)."""
    from attnbench.runner.group import measure_unit

    targets = cells
    if cells[0].device.startswith("cuda:"):  # the task sees only the GPU Ray gave it, as cuda:0
        targets = tuple(dataclasses.replace(c, device="cuda") for c in cells)
    rows = measure_unit(targets, settings, run_id)
    described = cpu_env.describe()
    for cell, target, row in zip(cells, targets, rows, strict=True):
        row.update(described)
        if target is not cell:
            row.update(device=cell.device, cell_id=cell.cell_id, group_id=cell.group_id)
            _add_note(row, f"ray ran {cell.device} on the GPU it assigned (GPU {','.join(info['gpus'])} of {info['host']})")
        row.update(host=info["host"], worker=info["worker"])
    return rows


def _unit_stream(cells: tuple[Cell, ...], settings: Settings, run_id: str, driver_cwd: str):
    info = _prepare(cells, settings, driver_cwd)
    with _node_lock(cells) as held:  # before the start is reported: waiting does not count towards the timeout
        yield info
        for row in _measure(cells, settings, run_id, info):  # noqa: UP028  (Ray sends into this generator)
            yield held.annotate(row)  # a group's rows come together, when its timing is done


def _unit_once(cells: tuple[Cell, ...], settings: Settings, run_id: str, driver_cwd: str) -> tuple[dict, list[dict]]:
    info = _prepare(cells, settings, driver_cwd)
    with _node_lock(cells) as held:
        return info, [held.annotate(row) for row in _measure(cells, settings, run_id, info)]


def _node_lock(cells: tuple[Cell, ...]):
    """This node's machine lock (:mod:`attnbench.measure.machine_lock`) for the unit's device, as this worker sees
    it (Ray gives a CUDA task its GPU as ``cuda``): another measurement on the node waits, or this unit does."""
    from attnbench.measure import machine_lock

    device = "cuda" if cells[0].device.startswith("cuda") else cells[0].device
    return machine_lock.measuring([device], purpose=f"attnbench Ray unit {cells[0].cell_id}"
                                  + (f" and {len(cells) - 1} more" if len(cells) > 1 else ""))


# Distinct functions per device kind: Ray fixes max_calls per function (1 for GPU tasks: a fresh
# process, hence a fresh CUDA context that sees exactly the GPU Ray assigned). Retries are ours.
def _cpu_unit_stream(cells, settings, run_id, driver_cwd):
    yield from _unit_stream(cells, settings, run_id, driver_cwd)


def _gpu_unit_stream(cells, settings, run_id, driver_cwd):
    yield from _unit_stream(cells, settings, run_id, driver_cwd)


def _cpu_unit_once(cells, settings, run_id, driver_cwd):
    return _unit_once(cells, settings, run_id, driver_cwd)


def _gpu_unit_once(cells, settings, run_id, driver_cwd):
    return _unit_once(cells, settings, run_id, driver_cwd)


_TASKS = {
    ("cpu", True): ray.remote(num_cpus=1, max_retries=0)(_cpu_unit_stream),
    ("cuda", True): ray.remote(num_cpus=1, num_gpus=1, max_calls=1, max_retries=0)(_gpu_unit_stream),
    ("cpu", False): ray.remote(num_cpus=1, max_retries=0)(_cpu_unit_once),
    ("cuda", False): ray.remote(num_cpus=1, num_gpus=1, max_calls=1, max_retries=0)(_gpu_unit_once),
}


def _add_note(row: dict, note: str) -> None:
    row["notes"] = "; ".join(n for n in (row.get("notes") or "", note) if n)


def _first_line(exc: BaseException, limit: int = 400) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""


# ---------------------------------------------------------------------------------------------------
# In the driver


@dataclasses.dataclass
class _Job:
    unit: WorkUnit
    ref: object  # an ObjectRefGenerator (start, then a row per cell) or, through Ray Client, an ObjectRef of (start, rows)
    attempt: int = 1
    info: dict | None = None
    started: float | None = None  # driver clock when the worker reported the start, or the last row came
    killed: bool = False
    retry_note: str = ""
    done: int = 0  # cells of the unit whose rows came back

    @property
    def cell(self) -> Cell:
        """The cell being measured now (the first whose row has not come back)."""
        return self.unit.cells[min(self.done, len(self.unit.cells) - 1)]


class RayExecutor:
    """Work units as Ray tasks, each holding its device exclusively; rows come back as cells finish.

    A Ray this process is already connected to (``ray.init`` in a notebook) is used as it is and left
    connected. Otherwise ``address=None`` starts a private local instance (:func:`start_local`) on the
    first ``execute`` and shuts it down on :meth:`close`; any other address (``auto``, ``host:6379``,
    ``ray://host:10001``) joins that cluster, and closing only disconnects this driver.
    ``on_start(cell)`` is called when a worker starts the cell (through Ray Client, which cannot
    stream, just before its row). :meth:`environment` describes every node that ran a cell.
    """

    name = "ray"
    concurrent = True  # units run at once on the cluster's workers: the session orders them longest first

    def __init__(self, settings: Settings, run_id: str, address: str | None = None, *,
                 kill_grace_s: float = KILL_GRACE_S):
        self.settings, self.run_id, self.address = settings, run_id, address
        self.kill_grace_s = kill_grace_s
        self._nodes: dict[str, dict] = {}
        self._owned = False  # this executor connected (or started Ray), so close() disconnects
        # The measuring environment goes into the environment each worker process starts with (a Ray worker
        # keeps one runtime_env for life). A preloaded allocator must be at the same path on every node.
        self.env_vars = cpu_env.process_env(cpu_env.CpuEnv(settings.cpu_allocator, settings.cpu_bind, settings.threads),
                                            base={})

    def environment(self) -> dict:
        """``nodes``: one ``attnbench.environment.collect()`` dict per node that ran cells (plus its Ray node id and
        IP). Each row records what its worker found in itself (``cpu_*`` columns)."""
        return {"workers": [], "nodes": list(self._nodes.values())}

    def execute(self, units: Iterable[WorkUnit], on_row: OnRow, on_start: OnStart | None = None) -> None:
        units = list(units)
        if not units:
            return
        if not ray.is_initialized():
            self._owned = self._connect()
        check_resources([c for u in units for c in u.cells], ray.nodes())
        self._run(units, on_row, on_start)

    def close(self) -> None:
        """Disconnect from Ray (and stop the private instance) when :meth:`execute` connected."""
        if self._owned:
            self._owned = False
            ray.shutdown()

    def _connect(self) -> bool:
        """Connect (or start) as configured; True when this call did, so ``execute`` disconnects after."""
        if ray.is_initialized():
            return False
        if self.address is None:
            start_local()
            return True
        try:
            ray.init(address=self.address)
        except Exception as exc:
            raise AttnbenchError(f"cannot connect to the Ray cluster at {self.address!r}: "
                                 f"{type(exc).__name__}: {_first_line(exc)}") from exc
        return True

    def _run(self, units: list[WorkUnit], on_row: OnRow, on_start: OnStart | None) -> None:
        streaming = not _client_mode()
        cwd = os.getcwd()
        jobs: dict = {}
        env_vars = self.env_vars

        def submit(unit: WorkUnit, attempt: int = 1, retry_note: str = "") -> None:
            cuda = unit.cells[0].device.startswith("cuda")
            task = _TASKS[("cuda" if cuda else "cpu", streaming)]
            ref = task.options(resources={CPU_SLOT: GPU_CELL_SLOT if cuda else 1},
                               runtime_env={"env_vars": env_vars}).remote(unit.cells, self.settings, self.run_id, cwd)
            jobs[ref] = _Job(unit, ref, attempt, retry_note=retry_note)

        def deliver(job: _Job, row: dict) -> None:
            if job.retry_note:
                _add_note(row, job.retry_note)
            cell = job.cell
            job.done += 1
            job.started = time.perf_counter()  # the next cell of the unit gets its own time window
            if job.done < len(job.unit.cells) and on_start:
                on_start(job.cell)
            on_row(cell, row)

        for unit in units:
            submit(unit)
        try:
            while jobs:
                ready, _ = ray.wait(list(jobs), num_returns=1, timeout=self._wait_s(jobs))
                for ref in ready:
                    job = jobs.pop(ref)
                    if self._take(job, streaming, submit, deliver, on_start):
                        jobs[ref] = job  # more rows come
                self._kill_overdue(jobs)
        except BaseException:  # Ctrl-C, or on_row failed: nothing may keep running for this sweep
            for ref in list(jobs):
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise

    def _take(self, job: _Job, streaming: bool, submit: Callable, deliver: Callable, on_start: OnStart | None) -> bool:
        """What a job Ray says is ready has: its start or its next row (streaming), or its start and every row, or its
        failure. A unit the cluster lost is submitted once more (what is left of it); a group whose task failed is
        measured again member by member. True when more rows are to come from this job."""
        try:
            if streaming:
                item = ray.get(next(job.ref))
                if job.info is None:
                    self._started(job, item, on_start)
                else:
                    deliver(job, item)
                return job.done < len(job.unit.cells)
            info, rows = ray.get(job.ref)
            self._started(job, info, on_start)
            for row in rows:
                deliver(job, row)
            return False
        except StopIteration:
            row = self._status_row(job, "error", "the Ray task ended without returning a row")
        except Exception as exc:
            row = self._failure_row(job, exc)
            if row is None:  # the cluster lost the unit: what is left of it, once more
                submit(dataclasses.replace(job.unit, cells=job.unit.cells[job.done:]), job.attempt + 1,
                       f"resubmitted once after {type(exc).__name__}: {_first_line(exc, 200)}")
                return False
        if len(job.unit.cells) > 1:  # a group's task failed: which member did it cannot be told here, so each
            note = (f"its comparison group's Ray task failed ({row['status']}: {row['error']}); "  # is measured
                    "measured again on its own, without paired speed-ups")  # alone
            for cell in job.unit.cells:
                submit(dataclasses.replace(job.unit, cells=(cell,)), job.attempt, note)
            return False
        deliver(job, row)
        return False

    def _started(self, job: _Job, info: dict, on_start: OnStart | None) -> None:
        job.info, job.started = info, time.perf_counter()
        self._nodes.setdefault(info["node_id"], info["env"])
        if on_start:
            on_start(job.cell)

    def _deadline_s(self, job: _Job | None = None) -> float | None:
        """Seconds a job's worker may go without a row: ``cell_timeout_s`` per cell still to come (a group's rows
        come together) plus the grace."""
        t = self.settings.cell_timeout_s
        if t == "auto":  # each Ray worker's own alarm applies its predicted timeout; the driver cancels nothing
            return None
        cells = len(job.unit.cells) - job.done if job is not None else 1
        return t * cells + self.kill_grace_s if t else None

    def _wait_s(self, jobs: dict) -> float:
        left = [self._deadline_s(j) - (time.perf_counter() - j.started) for j in jobs.values()
                if j.started and not j.killed and self._deadline_s(j)]
        return max(0.05, min([POLL_S, *left]))

    def _kill_overdue(self, jobs: dict) -> None:
        now = time.perf_counter()
        for job in jobs.values():
            limit = self._deadline_s(job)
            if limit and job.started is not None and not job.killed and now - job.started > limit:
                job.killed = True
                with contextlib.suppress(Exception):
                    ray.cancel(job.ref, force=True)

    def _status_row(self, job: _Job, status: str, error: str) -> dict:
        info = job.info or {}
        return failed_row(job.cell, self.run_id, status, error, host=info.get("host"),
                          worker=info.get("worker") or "ray", started_at=info.get("started_at"),
                          duration_s=time.perf_counter() - job.started if job.started else float("nan"))

    def _failure_row(self, job: _Job, exc: Exception) -> dict | None:
        """The row for a cell whose task failed, or None to resubmit it (a cluster failure, first time)."""
        what = f"{type(exc).__name__}: {_first_line(exc)}"
        if isinstance(exc, ray.exceptions.TaskCancelledError) and job.killed:
            return self._status_row(job, "timeout", f"cell exceeded its timeout of {self.settings.cell_timeout_s:g} s "
                                                    f"and did not stop (stuck in native code?); the Ray worker was "
                                                    f"killed after {self._deadline_s(job):g} s")
        if isinstance(exc, ray.exceptions.OutOfMemoryError):
            return self._status_row(job, "oom", f"Ray's memory monitor killed the worker (node memory nearly full): "
                                                f"{what}")
        if isinstance(exc, ray.exceptions.WorkerCrashedError):
            return self._status_row(job, "error", "the Ray worker process died while running the cell (segfault, "
                                                  f"abort, os._exit or a kill): {what}")
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            return self._status_row(job, "error", f"the Ray task failed: {type(cause).__name__}: {_first_line(cause)}")
        if isinstance(exc, _RESUBMIT) and job.attempt == 1:
            return None
        return self._status_row(job, "error", f"Ray could not run the cell: {what}")
