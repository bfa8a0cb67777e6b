"""One run of a sweep, from its folder to its results: started or resumed, scheduled, merged and finished.

:class:`RunSession` owns what ``attnbench.run`` does between the sweep and the table:

* **start / resume**: the run folder (:class:`~attnbench.results.store.RunStore`), ``meta.json``, the executor
  (:mod:`attnbench.runner.executors.base`) and the between-run term of every CI (:mod:`attnbench.measure.drift`);
* **schedule**: the cells that differ only in the implementation form a comparison group, the unit of work
  (:class:`~attnbench.runner.executors.base.WorkUnit`) an executor measures in one go, its members timed in
  alternation (:func:`~attnbench.runner.group.run_group`); every group once per round and measuring process, in a
  fresh seeded order each round, with the processes rotated so that no process always measures first (an executor
  that measures units at once, Ray, gets them longest first when earlier runs price them:
  :mod:`attnbench.runner.learned`);
* **merge**: the rows of a cell measured in several rounds and processes become one row
  (:func:`~attnbench.runner.cell.merge_rounds`); a cell that fails in any round is final as it failed and not run
  again; when every member of a group is final, the group's paired speed-ups against the sweep's baseline are
  added (:func:`~attnbench.runner.cell.add_speedups`) and its rows are stored;
* **finish**: the between-run term scaled for a run noisier than its calibration, the measuring environment and
  timings in ``meta.json``, and the folder consolidated. The rows stored by this session are kept in memory, so
  the folder is read once at the end (to consolidate it).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd

from attnbench import environment
from attnbench.devices import parse_device_type
from attnbench.measure import contention, cpu_env, drift, machine_lock, speedup_spread
from attnbench.results.schema import Cell
from attnbench.results.store import RunStore, load_run, new_run_id
from attnbench.runner import compile_cache, phases
from attnbench.runner.cell import add_speedups, merge_rounds, paired_base
from attnbench.runner.executors.base import Executor, WorkUnit
from attnbench.runner.learned import Learned, longest_first
from attnbench.runner.sweep import Settings, Sweep

Progress = Callable[[int, int, Cell, dict | None], None]


def sweep_to_dict(sweep: Sweep) -> dict:
    """A JSON-able description of the sweep (stored in ``meta.json``, used by ``--resume``)."""
    d = dataclasses.asdict(sweep)
    d["settings"] = dataclasses.asdict(sweep.settings)
    return d


def sweep_from_meta(meta: dict) -> Sweep:
    """The sweep a run was started with (for ``--resume``)."""
    data = dict(meta["sweep"])
    settings = Settings(**data.pop("settings"))
    return Sweep(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}, settings=settings)


def cpu_env_meta(settings: Settings) -> dict:
    """The measuring environment asked for, as recorded in ``meta.json`` (what held is added after the run)."""
    return {"allocator": settings.cpu_allocator, "bind": settings.cpu_bind,
            "omp": dict(cpu_env.OMP_BINDING) if settings.cpu_bind else {}, "threads": settings.threads,
            "processes": settings.processes, "rounds": settings.rounds,
            "malloc_threshold_bytes": cpu_env.PINNED_THRESHOLD_BYTES if settings.cpu_allocator == "pinned" else None}


def with_measuring_threads(sweep: Sweep, executor: str) -> Sweep:
    """``sweep`` with its measuring threads decided (:func:`attnbench.measure.cpu_env.measuring_threads`) for a local
    run of CPU cells under the controlled environment: the spare core takes the driver and the OS. Ray workers
    decide on their own node, other runs keep torch's default."""
    s = sweep.settings
    if s.threads is None and s.cpu_bind and executor == "local" and any(parse_device_type(d) == "cpu" for d in sweep.device):
        return dataclasses.replace(sweep, settings=dataclasses.replace(s, threads=cpu_env.measuring_threads(None, True)))
    return sweep


def with_baseline(sweep: Sweep) -> Sweep:
    """``sweep`` with the baseline of its speed-ups named in its settings (``--baseline``, else
    :func:`~attnbench.runner.sweep.default_baseline`), so every executor pairs against the same one."""
    return dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, baseline=sweep.baseline))


class RunSession:
    """One session of a run: :meth:`start` or :meth:`resume`, then :meth:`measure`, then :meth:`finish`."""

    def __init__(self, sweep: Sweep, store: RunStore, executor: Executor, done: set[str],
                 progress: Progress | None = None, executor_kind: str = "local"):
        self.sweep, self.store, self.executor, self.progress, self.done = sweep, store, executor, progress, done
        self.executor_kind = executor_kind
        settings = sweep.settings
        store.meta["baseline"] = sweep.baseline
        if settings.threads:  # set in the measuring processes (and recorded on every row)
            store.meta["torch_threads"] = settings.threads
        self.cells = [c for c in sweep.cells() if c.cell_id not in done]
        self.groups: dict[str, list[Cell]] = {}  # group_id -> its members (this session's), in the sweep's order
        for cell in self.cells:
            self.groups.setdefault(cell.group_id, []).append(cell)
        self.final: dict[str, dict[str, dict]] = {}  # group_id -> cell_id -> final row, until the group is complete
        self.units_per_cell = settings.rounds * settings.processes  # every cell once per round in each process
        self.total = len(self.cells) * self.units_per_cell
        # the between-run term of every CI, per device type, decided once per run
        self.drifts = {t: drift.term_for(settings.drift, t, settings.cpu_allocator)
                       for t in sorted({parse_device_type(d) for d in sweep.device})}
        store.meta["drift"] = {t: d.as_meta() for t, d in self.drifts.items()}
        store.write_meta()
        self.count = 0
        self.pending: dict[str, list[dict]] = {}  # ok rows of cells still owed more rounds
        self.stored: dict[str, tuple[dict, Path]] = {}  # cell_id -> (row, its cell file), this session's
        self.interrupted = False
        self._started = time.perf_counter()
        self._last_row = self._started  # when the last row came (or timing began)
        self._cut_short_s = 0.0  # after Ctrl-C: the time the cells in flight had had
        self.learned = None  # the cells' times learned from earlier runs, once measuring starts

    # ------------------------------------------------------------------ start or resume

    @classmethod
    def start(cls, sweep: Sweep, *, out: str | Path, executor: str, make_executor, run_id: str | None = None,
              argv: list[str] | None = None, progress: Progress | None = None) -> RunSession:
        """A new run folder under ``out`` for ``sweep``; the executor is made before the folder exists, so a setting
        that cannot work leaves nothing behind."""
        busy = environment.BusySample()  # the CPUs' other load, sampled while this process prepares the run
        sweep = with_baseline(with_measuring_threads(sweep, executor))
        meta = environment.collect(argv, busy=busy)
        meta.update(sweep=sweep_to_dict(sweep), executor=executor, cpu_env=cpu_env_meta(sweep.settings))
        run_id = run_id or new_run_id()
        run_exec = make_executor(executor, sweep.settings, run_id)
        return cls(sweep, RunStore(out, run_id=run_id, meta=meta), run_exec, set(), progress, executor)

    @classmethod
    def resume(cls, path: str | Path, *, executor: str, make_executor, sweep: Sweep | None = None,
               settings: dict | None = None, progress: Progress | None = None) -> RunSession:
        """Continue the run in ``path``, skipping the cells it has; measurement ``settings`` may change (a longer
        ``--cell-timeout``), the axes may not."""
        store = RunStore(path, resume=True)
        sweep = sweep or sweep_from_meta(store.meta)
        if settings:
            sweep = dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, **settings))
        sweep = with_baseline(sweep)
        done = store.done_cell_ids()
        run_exec = make_executor(executor, sweep.settings, store.run_id)
        store.meta["cpu_env"] = cpu_env_meta(sweep.settings)
        return cls(sweep, store, run_exec, done, progress, executor)

    # ------------------------------------------------------------------ schedule and merge

    def schedule(self) -> Iterator[list[WorkUnit]]:
        """The units of each (round, process) pass, in measuring order: one per comparison group, without the cells
        that are final already (failed in an earlier round)."""
        settings = self.sweep.settings
        rounds, processes = settings.rounds, settings.processes
        for r in range(rounds):
            for p in _process_order(r, processes):  # interleaved: a slow phase hits every process alike
                todo = [tuple(c for c in members if not self._is_final(c)) for members in self.groups.values()]
                todo = [members for members in todo if members]
                if getattr(self.executor, "concurrent", False) and isinstance(self.learned, Learned):
                    todo = longest_first(todo, self.learned)  # units measured at once: the longest first
                elif self.units_per_cell > 1:  # a fresh order each round, so slow phases of the machine hit every group alike
                    todo = random.Random(settings.seed * 1000 + r * processes + p).sample(todo, len(todo))
                yield [WorkUnit(members, process=p, round=r) for members in todo]

    def _is_final(self, cell: Cell) -> bool:
        return cell.cell_id in self.stored or cell.cell_id in self.final.get(cell.group_id, {})

    def measure(self, lock: str = "wait") -> None:
        """Execute every pass of the schedule (Ctrl-C propagates; every finished cell is kept), holding this
        machine's measurement lock while timing (:mod:`attnbench.measure.machine_lock`; ``lock``: ``wait`` for
        another measurement to end, ``no-wait``: raise instead, ``off``: measure anyway)."""
        plan = getattr(self.progress, "plan", None)  # a progress display that forecasts (attnbench.cli.progress)
        if plan or getattr(self.executor, "concurrent", False):
            self.learned = self._learn()
        if plan:
            plan(self.cells, self.sweep.settings, self.learned)
        held = machine_lock.acquire_for_run(self.sweep.device, self.executor_kind, lock, self.store.path)
        self._last_row = time.perf_counter()
        try:
            for units in self.schedule():
                self.executor.execute(units, self.on_row, self.on_start)
        except KeyboardInterrupt:  # the cells in flight are cut short from their last row on (finish says so)
            self._cut_short_s = time.perf_counter() - self._last_row
            raise
        finally:  # timing is over: the machine is free (consolidation and the report need no lock)
            held.release()
            machine_lock.record(self.store.meta, held)

    def _learn(self):
        """The cells' times learned from the earlier runs beside this one (:mod:`attnbench.runner.learned`), None
        when there are none, or the sentence saying why they could not be read (in ``meta.json`` too; the plan then
        stays analytic)."""
        from attnbench.runner import learned

        try:
            got = learned.learn(self.cells, self.store.path.parent)
            if got is not None:  # beside the run's own phases, so that a forecast can be judged afterwards
                self.store.meta["forecast"] = {"learned_cells_s": sum(got.unit_s.values()) * self.units_per_cell,
                                               "learned_cells": len(got.unit_s), "cells": got.cells, "runs": got.runs}
            return got
        except Exception as exc:  # noqa: BLE001 - an unreadable history must not stop a run; it is said
            note = f"forecast not learned from the earlier runs in {self.store.path.parent}: {type(exc).__name__}: {exc}"
            self.store.meta["forecast_note"] = note
            return note

    def on_start(self, cell: Cell) -> None:
        if self.progress:
            self.progress(self.count, self.total, cell, None)

    def on_row(self, cell: Cell, row: dict) -> None:
        """One round's row of ``cell``: held until the cell's last round, then merged and stored."""
        self.count += 1
        self._last_row = time.perf_counter()
        units = self.units_per_cell
        if row["status"] == "ok":
            self.pending.setdefault(cell.cell_id, []).append(row)
            if len(self.pending[cell.cell_id]) < units:
                if self.progress:
                    self.progress(self.count, self.total, cell, row)
                return
            row = merge_rounds(self.pending.pop(cell.cell_id), self.sweep.settings.processes,
                               self.drifts[parse_device_type(cell.device)].rel)
        elif units > 1:  # a cell that fails in any round is recorded as it failed, and not run again
            earlier_ok = len(self.pending.pop(cell.cell_id, []))
            self.count += units - earlier_ok - 1  # the rounds it will not run
            if earlier_ok:
                row = {**row, "notes": f"failed in round {earlier_ok + 1} of {units} after {earlier_ok} ok round(s); "
                                       + (row.get("notes") or "")}
        self.final.setdefault(cell.group_id, {})[cell.cell_id] = row
        if len(self.final[cell.group_id]) == len(self.groups[cell.group_id]):
            self._store_group(cell.group_id)
        if self.progress:
            self.progress(self.count, self.total, cell, row)

    def _store_group(self, group_id: str) -> None:
        """Store the final rows of a group, with paired speed-ups when it has two or more members."""
        rows = list(self.final.pop(group_id, {}).values())
        if len(rows) > 1:
            rows = add_speedups(rows, self.sweep.baseline)
        for row in rows:
            self.stored[row["cell_id"]] = (row, self.store.append(row))

    # ------------------------------------------------------------------ finish

    def finish(self, csv: bool = False) -> pd.DataFrame:
        """Close the executor, complete ``meta.json``, consolidate the folder; the run's table."""
        store, meta = self.store, self.store.meta
        self.executor.close()
        for group_id in list(self.final):  # interrupted: members that are final are kept, paired with what is there
            self._store_group(group_id)
        env = self.executor.environment()
        if env["workers"]:
            meta["cpu_env"]["measured"] = env["workers"]
            meta["torch_threads"] = env["workers"][0]["threads"]
        if env["nodes"]:  # merged by node, so a resumed run keeps earlier nodes
            nodes = {n.get("ray_node_id"): n for n in meta.get("nodes", [])}
            nodes.update({n.get("ray_node_id"): n for n in env["nodes"]})
            meta["nodes"] = list(nodes.values())
        changed: set[str] = set()
        self._scale_drift(changed)
        self._widen_speedups(changed)
        for cell_id in sorted(changed):  # each remade row's cell file rewritten once, after both passes
            row, path = self.stored[cell_id]
            self.store.rewrite(path, row)
        wall_s = time.perf_counter() - self._started
        meta["wall_s"] = meta.get("wall_s", 0.0) + wall_s
        meta["phases"] = phases.merge(meta.get("phases"), self._phases(wall_s))
        meta["compile_cache_dir"] = self.executor_compile_cache_dir()
        meta["interrupted"] = self.interrupted
        meta["load_average_1m_end"] = environment.load_average()
        store.write_meta()
        try:
            df = store.consolidate(csv=csv)
            store.meta["peak_gflops"] = {f"{d}/{t}": float(v) for (d, t), v in
                                         df[df.status == "ok"].groupby(["device", "dtype"])["peak_gflops_per_s"].max().items()}
            store.meta["contended_cells"] = int(contention.contended_mask(df).sum())  # how much of the run was contended
            store.write_meta()
        finally:
            store.close()  # the run folder's lock: the run can be resumed from now on
        df.attrs.update(run_dir=str(store.path), run_id=store.run_id, interrupted=self.interrupted,
                        session_wall_s=wall_s)
        return df

    def _phases(self, wall_s: float) -> dict[str, float]:
        """This session's phases (:mod:`attnbench.runner.phases`): its rows', the workers' start-up, the lock waited
        (the CLI adds its own start-up and the report). An interrupted session counts the rounds it measured of
        cells it did not finish (their rows are not kept, their time was spent) and the time the cells in flight
        had had as ``interrupted``, so that neither reads as bookkeeping."""
        clock = getattr(self.executor, "clock", None)
        held = (self.store.meta.get("machine_lock") or [{}])[-1]
        rows = [r for r, _ in self.stored.values()]
        if self.interrupted:
            rows += [r for pending in self.pending.values() for r in pending]
        return phases.account(rows, wall_s, workers_s=clock.seconds.get("workers", 0.0) if clock else 0.0,
                              locks_s=float(held.get("waited_s") or 0.0),
                              interrupted_s=self._cut_short_s if self.interrupted else 0.0)

    def executor_compile_cache_dir(self) -> str | None:
        """Where the measuring processes keep torch.compile's caches (None when they are not this machine's)."""
        env = getattr(self.executor, "env_vars", None)
        return env.get(compile_cache.ENV_DIR) if env else None

    def _scale_drift(self, changed: set[str]) -> None:
        """A device type whose cells' round medians spread more than the calibration runs' gets its between-run term
        scaled up (:meth:`attnbench.measure.drift.Drift.for_run`), every ok row's CI remade with it, and
        ``meta.json`` says so. Reads rows this session stored from memory; a resumed run's earlier rows from the
        folder, only when some of them need remaking."""
        rows = [r for r, _ in self.stored.values()]
        if self.done:  # a resumed run: its earlier sessions' rows count too
            old, _ = load_run(self.store.path)
            rows += [r for r in old.to_dict("records") if r["cell_id"] not in self.stored]
        if not rows:
            return
        df = pd.DataFrame(rows)
        kinds = df["device"].astype(str).map(parse_device_type)
        for kind, base in self.drifts.items():
            of_kind = df[kinds == kind]
            spread = drift.round_spread(of_kind) if len(of_kind) else None
            scaled = base.for_run(spread)
            self.store.meta["drift"][kind] = {**scaled.as_meta(), "calibrated_rel": base.rel, "round_spread": spread}
            fp32 = of_kind[(of_kind["status"] == "ok") & (of_kind["dtype"].astype(str) == "float32")]["peak_gflops_per_s"]
            fp32 = fp32.dropna()
            warning = base.speed_warning(float(fp32.median()) if len(fp32) else None)
            if warning:
                self.store.meta["drift"][kind]["warning"] = warning
            # rows whose CI was widened with another term (NaN: measured before the term existed); usually none.
            # A resumed run's earlier rows are remade with this session's term.
            stale = of_kind[(of_kind["status"] == "ok") & (of_kind["drift_rel"].fillna(0.0) != scaled.rel)]
            if len(stale):
                changed |= self._remake(set(stale["cell_id"]), scaled.rel)

    def _widen_speedups(self, changed: set[str]) -> None:
        """Every paired speed-up's interval at least as wide as its rounds' spread says (per device type: the
        between-round SD pooled over this session's cells, and the run-level SD, :mod:`attnbench.measure.speedup_spread`);
        ``meta.json`` (``speedup_spread``) records both per device type. A resumed run's earlier rows keep theirs.
        The rows this session stored are updated in memory and their ids added to ``changed`` (their files are
        rewritten once, by :meth:`finish`)."""
        by_kind: dict[str, list[dict]] = {}
        for row, _ in self.stored.values():
            by_kind.setdefault(parse_device_type(str(row.get("device"))), []).append(row)
        self.store.meta["speedup_spread"] = {}
        for kind, rows in by_kind.items():
            rounds = speedup_spread.per_round(rows, paired_base)
            sd, cells = speedup_spread.pooled(rounds.values())
            run, source = speedup_spread.run_sd(kind, self.sweep.settings.cpu_allocator)
            self.store.meta["speedup_spread"][kind] = {"sd": sd, "cells": cells, "prior_df": speedup_spread.PRIOR_DF,
                                                       "run_sd": run, "run_sd_source": source}
            for cell_id, x in rounds.items() if sd is not None else ():
                row, path = self.stored[cell_id]
                own = speedup_spread.moderated_sd(x, sd)
                lo, hi = speedup_spread.widened(row, own, len(x), run)
                self.stored[cell_id] = ({**row, "speedup_ci_low": lo, "speedup_ci_high": hi, "speedup_spread_rel": own},
                                        path)
                changed.add(cell_id)

    def _remake(self, stale_ids: set[str], new: float) -> set[str]:
        """The ok rows of ``stale_ids`` with their CI remade with the between-run term ``new``: this session's in memory
        (their ids returned, for :meth:`finish` to rewrite), an earlier session's in the folder."""

        def remake(row: dict) -> dict | None:
            if row["status"] != "ok" or row["cell_id"] not in stale_ids:
                return None
            old = row.get("drift_rel")
            old = 0.0 if old is None or old != old else float(old)
            lo, hi = drift.rewiden(row["median_s"], row["ci_low_s"], row["ci_high_s"], old, new)
            return {**row, "ci_low_s": lo, "ci_high_s": hi, "ci_rel": (hi - lo) / 2 / row["median_s"], "drift_rel": new}

        mine = set(self.stored)
        changed = set()
        for cell_id in stale_ids & mine:
            row, path = self.stored[cell_id]
            new_row = remake(row)
            if new_row is not None:
                self.stored[cell_id] = (new_row, path)
                changed.add(cell_id)
        if stale_ids - mine:  # rows of an earlier session of a resumed run: found in the folder
            self.store.rewrite_cells(lambda row: None if row["cell_id"] in mine else remake(row))
        return changed


def _process_order(round_index: int, processes: int) -> list[int]:
    """The processes of one round, rotated each round so that no process always measures first."""
    return [(round_index + i) % processes for i in range(processes)]
