"""Executors on this machine: in this process, or in measuring worker processes under a controlled environment.

Both have the interface of :mod:`attnbench.runner.executors.base` (as the Ray executor does):
``execute(units, on_row, on_start)`` calls ``on_row(cell, row)`` as each cell finishes and returns when all
are done or the run is interrupted; ``close()``; ``environment()``.

:class:`InProcessExecutor` measures in the calling process, outside the controlled environment (for cells of
implementations registered only there, and for tests and debugging).

:class:`WorkerExecutor` (what ``attnbench run`` uses) measures in worker processes started with the
controlled CPU environment (:mod:`attnbench.measure.cpu_env`): torch is imported once per process and
the process serves many cells. With ``processes=N`` it keeps N of them and the runner measures every
cell in each (a unit's ``process``), one process at a time: the others are stopped
(``SIGSTOP``), so their spinning OpenMP threads cannot take cores from the one measuring. With
``isolate`` every cell gets a fresh process. A crash (segfault, abort, ``os._exit``) becomes an
``error`` row naming the signal or exit code and the next cell gets a new process; a cell past
``cell_timeout_s`` (plus a grace for its own alarm) is killed and becomes a ``timeout`` row.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict

from attnbench.errors import AttnbenchError
from attnbench.measure import cpu_env, oom
from attnbench.results.schema import Cell, failed_row, normalise_row
from attnbench.runner import budget, compile_cache, phases
from attnbench.runner.executors import ahead, orphans
from attnbench.runner.executors.base import OnRow, OnStart, WorkUnit
from attnbench.runner.sweep import Settings, for_round

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for a worker to import torch and say it is ready (a loaded machine can take minutes)."""
KILL_GRACE_S = 10.0
"""Seconds past ``cell_timeout_s`` after which a cell its own alarm did not stop (native code) is killed."""


class _Timeout:
    """The worker did not answer in time."""


def _signal_text(returncode: int) -> str:
    if returncode >= 0:
        return f"worker process exited with code {returncode}"
    try:
        return f"worker process died with {signal.Signals(-returncode).name}"
    except ValueError:
        return f"worker process died with signal {-returncode}"


class WorkerProcess:
    """One measuring process (``python -m attnbench.runner.executors.worker``) and its JSON-lines pipe."""

    def __init__(self, env: dict[str, str], label: str, startup_timeout_s: float = STARTUP_TIMEOUT_S, wait: bool = True,
                 started: tuple[subprocess.Popen, object] | None = None):
        """``started``: the process and stderr file of a worker already started with ``env`` and ``label``
        (:func:`attnbench.runner.executors.ahead.take`), else one is started (:func:`~attnbench.runner.executors.ahead.spawn`)."""
        self.label = label
        self.proc, self._stderr = started or ahead.spawn(env, label)
        self._buf = b""
        self.stopped = False
        self.busy = False  # a request is in flight: the worker reads no input until it answers
        self.killed = False  # we killed it (a timeout, an interrupted run): its SIGKILL is ours
        self._startup_timeout_s = startup_timeout_s
        self.info: dict | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the worker says it is ready (started with ``wait=False``: while the caller did other work)."""
        if self.info is not None:
            return
        ready = self._read(self._startup_timeout_s)
        if not isinstance(ready, dict) or "ready" not in ready:
            why = "did not start in time" if isinstance(ready, _Timeout) else self.death()
            self.close()
            raise AttnbenchError(f"the measuring worker process could not start: {why}")
        self.info = ready["ready"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, timeout_s: float | None):
        """The next message, ``None`` at end of output (the worker died), or a :class:`_Timeout`."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                return _Timeout()
            data = os.read(fd, 1 << 20)
            if not data:
                return None
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def read(self, timeout_s: float | None = None):
        """The next message of a request in progress, ``None`` if the worker died, or a :class:`_Timeout`."""
        answer = self._read(timeout_s)
        self.busy = isinstance(answer, dict) and ("at" in answer or "plan" in answer)
        return answer

    def request(self, message: dict, timeout_s: float | None = None):
        """Send one request; its answer (or first progress message), ``None`` if the worker died, or a
        :class:`_Timeout`."""
        self.resume()
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        self.busy = True
        return self.read(timeout_s)

    def kill(self) -> None:
        """``SIGKILL`` the worker's process group (it and whatever it started), now."""
        self.killed = True
        orphans.kill_group(self.proc.pid)

    def probe(self) -> dict:
        """What the worker finds inside itself (see the worker module): for tests and ``--json`` reports."""
        answer = self.request({"probe": True}, STARTUP_TIMEOUT_S)
        if not isinstance(answer, dict):
            raise AttnbenchError(f"the measuring worker did not answer a probe: {self.death()}")
        return answer["probe"]

    def death(self) -> str:
        """Why the worker is gone: the signal or exit code and the last lines it wrote to stderr."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "worker process stopped answering"
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-3:]
        return _signal_text(code) + (": " + " | ".join(tail) if tail else "")

    def suspend(self) -> None:
        """Stop the process (``SIGSTOP``) while another one measures: its OpenMP threads may be spinning."""
        if not self.stopped and hasattr(signal, "SIGSTOP") and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.stopped and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        """End the process (end of input; killed if it does not leave promptly, or at once while it is busy with a
        request, as when the run is interrupted: it would not read its input before finishing the cell)."""
        self.resume()
        if self.busy and self.proc.poll() is None:
            self.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()


class WorkerPool:
    """Idle measuring workers kept for the next run in this process, by measuring environment and label.

    Off by default (every run starts its own workers, so nothing an earlier run imported or cached can reach it).
    Inside :func:`shared_workers` (the test suite; a notebook making many small runs) a run takes a live idle
    worker of the same environment and working directory instead of starting one, which saves the seconds of
    importing torch, and gives its workers back at the end. A shared worker keeps the plug-ins it imported: a
    plug-in file edited between runs needs a fresh worker (leave the block). Runs with ``isolate`` never share:
    each of their cells gets a fresh process.
    """

    def __init__(self) -> None:
        self.idle: dict[tuple, list[WorkerProcess]] = {}

    def take(self, key: tuple) -> WorkerProcess | None:
        """A live idle worker for ``key``, or None."""
        while self.idle.get(key):
            worker = self.idle[key].pop()
            if worker.proc.poll() is None:
                try:
                    worker.wait_ready()  # one started ahead (prestarted) may still be importing torch
                except AttnbenchError:  # closed; the run starts its own, which says why it cannot
                    continue
                return worker
            worker.close()
        return None

    def give(self, key: tuple, worker: WorkerProcess) -> None:
        """Keep ``worker`` (alive, resumed) for a later run."""
        worker.resume()
        if worker.proc.poll() is None:
            self.idle.setdefault(key, []).append(worker)
        else:
            worker.close()

    def close(self) -> None:
        """End every idle worker."""
        for workers in self.idle.values():
            for worker in workers:
                worker.close()
        self.idle.clear()


_SHARED: WorkerPool | None = None


@contextlib.contextmanager
def shared_workers():
    """Within the block, runs in this process share their measuring worker processes (:class:`WorkerPool`)."""
    global _SHARED
    outer, _SHARED = _SHARED, WorkerPool()
    try:
        yield _SHARED
    finally:
        _SHARED.close()
        _SHARED = outer


@contextlib.contextmanager
def prestarted(settings: Settings, devices: Iterable[str] = ("cpu",)):
    """Within the block, the first measuring worker of a local run with ``settings`` is started ahead, so that it
    imports torch while this process does (the command's start-up: issue 30); the run takes it from a
    :class:`WorkerPool` when its environment matches, and any worker left is ended with the block. Nothing is
    started inside :func:`shared_workers` (its pool serves), with ``isolate``, or when a device is not the CPU."""
    if _SHARED is not None or settings.isolate or any(not str(d).startswith("cpu") for d in devices):
        yield
        return
    threads = settings.threads or (cpu_env.measuring_threads(None, True) if settings.cpu_bind else None)
    env = cpu_env.CpuEnv(settings.cpu_allocator, settings.cpu_bind, threads)
    with shared_workers() as pool:
        env_vars = compile_cache.worker_env(cpu_env.process_env(env))
        worker = WorkerProcess(env_vars, ahead.LABEL, wait=False, started=ahead.take(env_vars, ahead.LABEL))
        pool.idle.setdefault((env, 0, os.getcwd()), []).append(worker)
        yield


def resolvable(name: str, names: Iterable[str]) -> bool:
    """Can a fresh process resolve the implementation ``name``? (Not one registered in this process only.)"""
    if name.startswith("compiled:"):
        return resolvable(name[len("compiled:"):].partition("@")[0], names)
    return ":" in name or name in set(names)


def _announce(plan: dict) -> None:
    """Say which cells of a unit measured here are predicted to take minutes, before they start."""
    for line in plan["announce"]:
        print(f"note: {line}", file=sys.stderr, flush=True)


class InProcessExecutor:
    """Cells measured in this process, one after another, outside the controlled CPU environment (glibc's malloc
    is still pinned when asked; OpenMP binding can no longer apply once torch is loaded). Every row says so."""

    name = "inprocess"
    NOTE = "measured in the calling process, outside the controlled CPU environment"

    def __init__(self, settings: Settings, run_id: str, note: str = NOTE):
        self.settings, self.run_id, self.note = settings, run_id, note
        self.reports: list[dict] = []

    def execute(self, units: Iterable[WorkUnit], on_row: OnRow, on_start: OnStart | None = None) -> None:
        for unit in units:
            for cell in unit.cells:
                if on_start:
                    on_start(cell)
            for cell, row in zip(unit.cells, self.run_unit(unit.cells, for_round(self.settings, unit.round)), strict=True):
                on_row(cell, row)

    def run_unit(self, cells: tuple[Cell, ...], settings: Settings | None = None) -> list[dict]:
        """Measure ``cells`` (one cell, or the members of a comparison group timed in alternation) here (``settings``:
        this unit's, default the executor's)."""
        from attnbench.runner.group import measure_unit  # not at import: a command starts its worker first

        if self.settings.cpu_allocator == "pinned":
            cpu_env.pin_glibc_malloc()  # mallopt still applies in this process; OpenMP binding no longer can
        rows = measure_unit(cells, settings or self.settings, self.run_id, on_plan=_announce)
        described = cpu_env.describe(torch_loaded_before_env=True)
        for row in rows:
            row.update(described)
            row["notes"] = "; ".join(n for n in (row.get("notes"), self.note) if n)
        report = {**described, "threads": rows[0]["threads"]}
        if report not in self.reports:
            self.reports.append(report)
        return rows

    def close(self) -> None:
        pass

    def environment(self) -> dict:
        return {"workers": list(self.reports), "nodes": []}


class WorkerExecutor:
    """Cells in measuring worker processes under a controlled CPU environment (see the module docstring)."""

    name = "workers"

    def __init__(self, settings: Settings, run_id: str):
        self.settings, self.run_id = settings, run_id
        self.env = cpu_env.CpuEnv(settings.cpu_allocator, settings.cpu_bind, settings.threads)
        self.env_vars = cpu_env.process_env(self.env)  # a missing library fails here, before anything runs
        self.env_vars = compile_cache.worker_env(self.env_vars)  # torch.compile's caches kept per machine
        self.clock = phases.Clock()  # the driver's phases: the workers' start-up
        self._unit_settings = settings  # the unit being measured (attnbench.runner.sweep.for_round)
        self.pool = None if settings.isolate else _SHARED
        self.workers: dict[int, WorkerProcess] = {}
        self.reports: list[dict] = []  # what each worker found in itself
        # (device, dtype) -> GFLOP/s measured by the first ok cell, passed on so that later workers
        # (a fresh one per cell with isolate, or per process) do not measure it again
        self.peaks: dict[tuple[str, str], float] = {}
        self._warned = False
        self._timeout_s: float | None = None  # the request in flight's timeout (its worker's plan says it)
        self._oom_before: dict[str, int] = {}
        orphans.end_orphans(lambda line: print(line, file=sys.stderr, flush=True))  # before taking the machine lock
        self._here = InProcessExecutor(settings, run_id, note="measured in the calling process (the implementation "
                                       "is registered there only), outside the controlled CPU environment")

    def _pool_key(self, process: int) -> tuple:
        # the working directory too: a plug-in given as a relative path resolves from the worker's own
        return (self.env, process, os.getcwd())

    def _start(self, process: int) -> WorkerProcess:
        label = "subprocess" if self.settings.isolate else f"process{process}"
        with self.clock("workers"):
            worker = (self.pool.take(self._pool_key(process)) if self.pool else None) or WorkerProcess(self.env_vars, label)
        info = {k: worker.info[k] for k in ("cpu_allocator", "cpu_binding", "cpu_affinity", "threads")}
        if info not in self.reports:
            self.reports.append(info)
        if not self._warned:
            self._warned = True
            cpu_env.warn_unpinned(self.env, worker.info)
        return worker

    def _worker(self, process: int) -> WorkerProcess:
        for p, other in self.workers.items():
            if p != process:
                other.suspend()
        worker = self.workers.get(process)
        if worker is None or worker.proc.poll() is not None:
            worker = self.workers[process] = self._start(process)
        return worker

    def execute(self, units: Iterable[WorkUnit], on_row: OnRow, on_start: OnStart | None = None) -> None:
        for unit in units:
            self._unit_settings = for_round(self.settings, unit.round)  # later rounds skip the memory/FLOP pass
            if len(unit.cells) == 1:
                if on_start:
                    on_start(unit.cells[0])
                on_row(unit.cells[0], self.run_one(unit.cells[0], unit.process))
                continue
            for cell in unit.cells:
                if on_start:
                    on_start(cell)
            for cell, row in self.run_group(unit.cells, unit.process):
                on_row(cell, row)

    def run_group(self, cells: tuple[Cell, ...], process: int = 0) -> list[tuple[Cell, dict]]:
        """Measure the comparison group ``cells`` in worker ``process`` (a fresh one with ``isolate``), timed in
        alternation; ``(cell, row)`` for each member.

        The worker says which member it is working on before each step (``{"at": cell_id}``), so a member that
        kills the process or hangs in native code is recorded as it is for a single cell (an ``error`` or ``oom``
        row naming the death, a ``timeout`` row), and the group is measured again without it in a fresh process:
        the other members' rows are measured, never lost.
        """
        worker = self._worker(process)
        if not all(resolvable(c.impl, worker.info["names"]) for c in cells):
            return list(zip(cells, self._here.run_unit(cells, self._unit_settings), strict=True))
        answer, at = self._converse(worker, {"group": [asdict(c) for c in cells]}, cells)
        if isinstance(answer, dict) and "rows" in answer:
            rows = [normalise_row(r) for r in answer["rows"]]
            self._keep_peak((cells[0].device, cells[0].dtype), rows)
            if self.settings.isolate:
                self._drop(process)
            return list(zip(cells, rows, strict=True))
        culprit = next(c for c in cells if c.cell_id == at)
        row = self._lost_worker_row(culprit, worker, answer, process)
        rest = tuple(c for c in cells if c is not culprit)
        note = f"measured again without {culprit.impl}, which {'hung' if row['status'] == 'timeout' else 'killed'} " \
               "the measuring process"
        if len(rest) == 1:
            again = [(rest[0], self.run_one(rest[0], process))]
        else:
            again = self.run_group(rest, process)
        for _, other in again:
            other["notes"] = "; ".join(n for n in (other.get("notes"), note) if n)
        return [(culprit, row), *again]

    def _converse(self, worker: WorkerProcess, request: dict, cells: tuple[Cell, ...]):
        """Send ``request`` (a cell or a group) and follow the worker's progress to its answer: ``(answer, the cell
        it was at)``. The worker's plan (``{"plan": ...}``) sets the wait (its timeout plus a grace for its own
        alarm) and says which cells are predicted to take minutes; each step (``{"at": cell_id}``) restarts it."""
        key = (cells[0].device, cells[0].dtype)
        self._timeout_s = budget.seconds(self.settings.cell_timeout_s, cells[0])
        self._oom_before = oom.snapshot()
        request = {**request, "settings": asdict(self._unit_settings), "run_id": self.run_id,
                   "peak_gflops_per_s": self.peaks.get(key)}
        answer = worker.request(request, self._wait_s())
        at = cells[0].cell_id
        while isinstance(answer, dict) and ("at" in answer or "plan" in answer):
            if "plan" in answer:
                self._timeout_s = answer["plan"]["timeout_s"]
                for line in answer["plan"]["announce"]:
                    print(f"note: {line}", file=sys.stderr, flush=True)
            else:
                at = answer["at"]
            answer = worker.read(self._wait_s())
        return answer, at

    def _wait_s(self) -> float | None:
        return self._timeout_s + KILL_GRACE_S if self._timeout_s else None

    def _keep_peak(self, key: tuple[str, str], rows: list[dict]) -> None:
        for row in rows:
            peak = row.get("peak_gflops_per_s")
            if isinstance(peak, float) and math.isfinite(peak) and peak > self.peaks.get(key, 0.0):  # a re-measured one
                self.peaks[key] = peak

    def _lost_worker_row(self, cell: Cell, worker: WorkerProcess, answer, process: int) -> dict:
        """The row of ``cell`` when its worker did not answer: a ``timeout`` (the worker is killed), an ``oom`` (the
        kernel's OOM killer, as its counters show) or an ``error`` naming the death; the worker is dropped either way."""
        where = dict(worker=f"{worker.label} pid{worker.pid}", cpu_allocator=worker.info["cpu_allocator"],
                     cpu_binding=worker.info["cpu_binding"], cpu_affinity=worker.info["cpu_affinity"],
                     timeout_s=math.nan if self._timeout_s is None else float(self._timeout_s))
        if isinstance(answer, _Timeout):
            worker.kill()
            row = failed_row(cell, self.run_id, "timeout", f"cell exceeded its timeout of {self._timeout_s:g} s and did "
                             "not stop (stuck in native code?); the worker process was killed (--cell-timeout SECONDS "
                             "or none to change it)", **where)
        else:
            death = worker.death()
            why = oom.explain(worker.proc.returncode, self._oom_before, oom.snapshot()) if not worker.killed else None
            status = "oom" if oom.is_oom(why) else "error"
            row = failed_row(cell, self.run_id, status, f"{death}: {why}" if why else death, **where)
        self._drop(process)
        return row

    def run_one(self, cell: Cell, process: int = 0) -> dict:
        """Measure ``cell`` in worker ``process`` (a fresh one with ``isolate``) and return its row."""
        worker = self._worker(process)
        if not resolvable(cell.impl, worker.info["names"]):
            return self._here.run_unit((cell,), self._unit_settings)[0]
        answer, _ = self._converse(worker, {"cell": asdict(cell)}, (cell,))
        if isinstance(answer, dict) and "row" in answer:
            row = normalise_row(answer["row"])
            self._keep_peak((cell.device, cell.dtype), [row])
            if self.settings.isolate:
                self._drop(process)
            return row
        return self._lost_worker_row(cell, worker, answer, process)

    def _drop(self, process: int) -> None:
        worker = self.workers.pop(process, None)
        if worker is not None:
            worker.close()

    def close(self) -> None:
        """End every worker process (or, inside :func:`shared_workers`, give them back for the next run)."""
        for p in list(self.workers):
            if self.pool is not None and not self.workers[p].busy:  # a busy one (an interrupted cell) is ended
                self.pool.give(self._pool_key(p), self.workers.pop(p))
            else:
                self._drop(p)

    def environment(self) -> dict:
        """What the worker processes found in themselves (distinct reports): for ``meta.json``."""
        return {"workers": list(self.reports), "nodes": []}

