"""``attnbench run``: expand a sweep, execute its cells, store each row as it finishes.

The engine behind the CLI, the Python API (``attnbench.run``), the asv suite and the Ray executor.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from attnbench import environment, registry
from attnbench.devices import cuda_available, parse_device, parse_device_type
from attnbench.errors import AttnbenchError, SweepError
from attnbench.measure import contention, drift, machine_lock
from attnbench.measure.cpu_env import OMP_BINDING, PINNED_THRESHOLD_BYTES, check_allocator, default_threads
from attnbench.results.schema import AXES, INT_AXES, Cell
from attnbench.results.store import RunStore, load_run, new_run_id
from attnbench.runner.cell import merge_rounds, torch_threads
from attnbench.runner.sweep import Settings, Sweep, load_preset, parse_axis, parse_strs, sweep_from_dict


def default_sweep() -> Sweep:
    """The built-in default: every implementation available here on a small CPU grid (preset ``default``)."""
    return sweep_from_dict(load_preset("default"), "default", available_impls=registry.available("cpu"))


def make_sweep(preset: str | None = None, file: str | Path | None = None, base: Sweep | None = None,
               settings: dict | None = None, executor: str = "local", **axes) -> Sweep:
    """Combine a preset or TOML file (or ``base``) with axis overrides (lists or strings like ``"128..1024x2"``).

    With neither a preset nor a file nor any axis, this is :func:`default_sweep`. With
    ``executor="ray"`` the devices are those of the cluster, so CUDA need not exist on this machine.
    """
    from attnbench.runner.sweep import load_toml

    given = {k: v for k, v in axes.items() if v is not None and not (isinstance(v, tuple | list | str) and not v)}
    unknown = set(given) - set(AXES)
    if unknown:
        raise SweepError(f"unknown sweep axis {sorted(unknown)}; axes are {', '.join(AXES)}")
    if preset and file:
        raise SweepError("give either a sweep file or --preset, not both")
    named: tuple[str, ...] = ()  # implementations the user named (not expanded from "available")
    if base is None:
        if file:
            data, name = load_toml(file), Path(file).stem
        elif preset or not given:
            data, name = load_preset(preset or "default"), preset or "default"
        else:
            data, name = {"sweep": {}}, "custom"
        devices = parse_strs(given.get("device") or data.get("sweep", {}).get("device", "cpu"))
        local = executor != "ray"
        for d in devices:
            # An unknown device, or (locally) CUDA that is not here: one clear error before anything runs.
            parse_device(d) if local else parse_device_type(d)
        avail = sorted({n for d in devices for n in _available_on(d, local)}, key=registry.names().index)
        if "impl" in given:  # named implementations replace the file's, and need not be available here
            data = {**data, "sweep": {**data.get("sweep", {}), "impl": list(parse_strs(given["impl"]))}}
        if "impl" in given or file:  # named by the user (a shipped preset's names are not the user's)
            named = tuple(i for i in parse_strs(data.get("sweep", {}).get("impl", ())) if i != "available")
        base = sweep_from_dict(data, name, available_impls=avail)
    overrides = {axis: parse_axis(axis, value) for axis, value in given.items()}
    sweep = dataclasses.replace(base, **overrides)
    if settings:
        sweep = dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, **settings))
    for name in sweep.impl:
        registry.get(name)  # unknown names and broken plug-ins fail before anything runs
    if set(sweep.mode) == {"decode"}:
        for name in named:  # asked for decoding only, by name: an implementation without a cache is a mistake
            if not registry.get(name).kv_cache:
                with_cache = [n for n in registry.names() if registry.get(n).kv_cache]
                raise SweepError(f"{name} has no KV cache, so it cannot run --mode decode; use one of "
                                 f"{', '.join(with_cache)} or add another mode")
    return sweep


def _available_on(device: str, local: bool = True) -> list[str]:
    """Implementations that run on ``device``: probed here, or (for a remote cluster) as declared."""
    if not local:
        kind = parse_device_type(device)
        return [n for n in registry.names() if kind in registry.get(n).devices]
    if device.startswith("cuda") and not cuda_available():
        return []
    return registry.available(device)


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


def make_executor(kind: str, settings: Settings, run_id: str, ray_address: str | None = None):
    """The executor called ``kind`` (``local``: measuring worker processes on this machine; ``ray``)."""
    check_settings(settings, kind)
    if kind == "local":
        from attnbench.runner.executors.local import WorkerExecutor

        return WorkerExecutor(settings, run_id)
    if kind == "ray":
        try:
            from attnbench.runner.executors.ray import RayExecutor
        except ImportError as exc:
            raise AttnbenchError(f"--executor ray needs Ray: pip install 'attnbench[ray]' ({exc})") from exc
        return RayExecutor(settings, run_id, address=ray_address)
    raise SweepError(f"unknown executor {kind!r}; use local or ray")


def check_settings(settings: Settings, executor: str = "local") -> None:
    """One clear error for measurement settings that cannot work (before anything runs)."""
    check_allocator(settings.cpu_allocator)
    drift.check_setting(settings.drift)
    if isinstance(settings.processes, bool) or not isinstance(settings.processes, int) or settings.processes < 1:
        raise SweepError(f"--processes must be a whole number >= 1, got {settings.processes!r}")
    if isinstance(settings.rounds, bool) or not isinstance(settings.rounds, int) or settings.rounds < 1:
        raise SweepError(f"--rounds must be a whole number >= 1, got {settings.rounds!r}")
    if executor == "ray" and settings.processes > 1:
        raise SweepError("--processes applies to local runs; on Ray use --rounds (each task runs in a Ray worker)")


def cpu_env_meta(settings: Settings) -> dict:
    """The measuring environment asked for, as recorded in ``meta.json`` (what held is added after the run)."""
    return {"allocator": settings.cpu_allocator, "bind": settings.cpu_bind,
            "omp": dict(OMP_BINDING) if settings.cpu_bind else {}, "threads": settings.threads,
            "processes": settings.processes, "rounds": settings.rounds,
            "malloc_threshold_bytes": PINNED_THRESHOLD_BYTES if settings.cpu_allocator == "pinned" else None}


def _scale_drift(store: RunStore, drifts: dict[str, drift.Drift]) -> None:
    """At the end of a run: a device type whose cells' round medians spread more than the calibration runs'
    gets its between-run term scaled up (:meth:`attnbench.measure.drift.Drift.for_run`), every ok row's CI
    remade with it, and ``meta.json`` says so."""
    df, _ = load_run(store.path)
    if not len(df):
        return
    kinds = df["device"].astype(str).map(parse_device_type)
    for kind, base in drifts.items():
        rows = df[kinds == kind]
        spread = drift.round_spread(rows) if len(rows) else None
        scaled = base.for_run(spread)
        store.meta["drift"][kind] = {**scaled.as_meta(), "calibrated_rel": base.rel, "round_spread": spread}
        fp32 = rows[(rows["status"] == "ok") & (rows["dtype"].astype(str) == "float32")]["peak_gflops_per_s"].dropna()
        warning = base.speed_warning(float(fp32.median()) if len(fp32) else None)
        if warning:
            store.meta["drift"][kind]["warning"] = warning

        # rows whose CI was widened with another term (NaN: measured before the term existed); usually none,
        # and then no cell file is read again. A resumed run's earlier rows are remade with this session's term.
        stale = rows[(rows["status"] == "ok") & (rows["drift_rel"].fillna(0.0) != scaled.rel)]
        if not len(stale):
            continue
        stale_ids = set(stale["cell_id"])

        def remake(row: dict, new=scaled.rel, stale_ids=stale_ids) -> dict | None:
            if row["status"] != "ok" or row["cell_id"] not in stale_ids:
                return None
            old = row.get("drift_rel")
            old = 0.0 if old is None or old != old else float(old)
            lo, hi = drift.rewiden(row["median_s"], row["ci_low_s"], row["ci_high_s"], old, new)
            return {**row, "ci_low_s": lo, "ci_high_s": hi, "ci_rel": (hi - lo) / 2 / row["median_s"], "drift_rel": new}

        store.rewrite_cells(remake)


def run(sweep: Sweep | None = None, *, out: str | Path = "results", resume: str | Path | None = None,
        executor: str = "local", ray_address: str | None = None, run_id: str | None = None,
        argv: list[str] | None = None, csv: bool = False, profile: bool = False,
        progress: Callable[[int, int, Cell, dict | None], None] | None = None,
        preset: str | None = None, file: str | Path | None = None, settings: dict | None = None,
        no_wait: bool = False, allow_concurrent: bool = False, **axes) -> pd.DataFrame:
    """Run a sweep and return its tidy results (one row per cell), written under ``out/<run_id>/``.

    ``sweep`` may be omitted: axes are then keyword arguments (``impl=["sdpa"], seq_len=[128, 256]``,
    or strings like ``seq_len="128..1024x2"``), optionally on top of a ``preset`` or a TOML ``file``;
    ``settings`` overrides measurement settings (``budget_s``, ``threads``, ``rounds``, ``processes``,
    ``cpu_allocator``, ``isolate``, ...). Cells are measured in worker processes started with the controlled
    CPU environment (:mod:`attnbench.measure.cpu_env`), never in the calling process (except implementations
    registered only there), so calling this from a notebook measures like ``attnbench run``.
    ``resume`` continues the run folder it names, skipping cells already recorded.
    ``progress(i, n, cell, row)`` is called before (row None) and after each cell.
    Timing holds this machine's measurement lock (:mod:`attnbench.measure.machine_lock`): with another
    measurement running, the run waits (``no_wait``: raises instead; ``allow_concurrent``: measures anyway).
    The run folder is locked while this writes it (:mod:`attnbench.results.lock`).

    The returned DataFrame has ``attrs["run_dir"]``, ``attrs["run_id"]`` and ``attrs["interrupted"]``
    (True after Ctrl-C: every finished cell is kept and the results are consolidated before returning).
    """
    if resume is not None:
        store = RunStore(resume, resume=True)
        if sweep is None:
            sweep = sweep_from_meta(store.meta)
        if settings:  # measurement settings may change on resume (e.g. a longer --cell-timeout); axes may not
            sweep = dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, **settings))
        done = store.done_cell_ids()
    else:
        if sweep is None:
            sweep = make_sweep(preset=preset, file=file, settings=settings, executor=executor, **axes)
        elif settings:
            sweep = dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, **settings))
        if (sweep.settings.threads is None and sweep.settings.cpu_bind and executor == "local"
                and any(parse_device_type(d) == "cpu" for d in sweep.device)):
            # the controlled environment leaves one core to the driver and the OS (cpu_env.default_threads)
            sweep = dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, threads=default_threads()))
        meta = environment.collect(argv)
        meta["sweep"] = sweep_to_dict(sweep)
        meta["executor"] = executor
        meta["cpu_env"] = cpu_env_meta(sweep.settings)
        run_id = run_id or new_run_id()
        run_exec = make_executor(executor, sweep.settings, run_id, ray_address)  # fails before any folder exists
        store = RunStore(out, run_id=run_id, meta=meta)
        done = set()
    if sweep.settings.threads:  # set in the measuring processes (and recorded on every row)
        store.meta["torch_threads"] = sweep.settings.threads
    cells = [c for c in sweep.cells() if c.cell_id not in done]
    rounds, processes = sweep.settings.rounds, sweep.settings.processes
    units = rounds * processes  # every cell is measured once per round in each process
    total = len(cells) * units
    counter = {"i": 0}
    if resume is not None:
        run_exec = make_executor(executor, sweep.settings, store.run_id, ray_address)
        store.meta["cpu_env"] = cpu_env_meta(sweep.settings)
    # the between-run term of every CI, per device type (attnbench.measure.drift), decided once per run
    drifts = {t: drift.resolve(sweep.settings.drift, t, sweep.settings.cpu_allocator)
              for t in sorted({parse_device_type(d) for d in sweep.device})}
    store.meta["drift"] = {t: d.as_meta() for t, d in drifts.items()}
    store.write_meta()
    pending: dict[str, list[dict]] = {}  # ok rows of cells still owed more rounds
    finished: set[str] = set()

    def on_start(cell: Cell) -> None:
        if progress:
            progress(counter["i"], total, cell, None)

    def on_row(cell: Cell, row: dict) -> None:
        counter["i"] += 1
        if row["status"] == "ok":
            pending.setdefault(cell.cell_id, []).append(row)
            if len(pending[cell.cell_id]) < units:
                if progress:
                    progress(counter["i"], total, cell, row)
                return
            row = merge_rounds(pending.pop(cell.cell_id), processes, drifts[parse_device_type(cell.device)].rel)
        elif units > 1:  # a cell that fails in any round is recorded as it failed, and not run again
            earlier_ok = len(pending.pop(cell.cell_id, []))
            counter["i"] += units - earlier_ok - 1  # the rounds it will not run
            if earlier_ok:
                row = {**row, "notes": f"failed in round {earlier_ok + 1} of {units} after {earlier_ok} ok round(s); "
                                       + (row.get("notes") or "")}
        finished.add(cell.cell_id)
        store.append(row)
        if progress:
            progress(counter["i"], total, cell, row)

    interrupted = False
    started = time.perf_counter()
    held = None
    try:
        # one measurement at a time on this machine: waits here while another one times
        held = machine_lock.acquire_for_run(sweep.device, executor, "off" if allow_concurrent else
                                            "no-wait" if no_wait else "wait", store.path)
        for r in range(rounds):
            for p in _process_order(r, processes):  # interleaved: a slow phase hits every process alike
                todo = [c for c in cells if c.cell_id not in finished]
                if units > 1:  # a fresh order each round, so slow phases of the machine hit every cell alike
                    todo = random.Random(sweep.settings.seed * 1000 + r * processes + p).sample(todo, len(todo))
                if processes > 1:
                    run_exec.execute(todo, on_row, on_start, process=p)
                else:
                    run_exec.execute(todo, on_row, on_start)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if held is not None:  # timing is over: the machine is free (consolidation and the report need no lock)
            held.release()
            machine_lock.record(store.meta, held)
        if hasattr(run_exec, "close"):
            run_exec.close()
        if hasattr(run_exec, "environment") and run_exec.environment():
            store.meta["cpu_env"]["measured"] = run_exec.environment()
            store.meta["torch_threads"] = run_exec.environment()[0]["threads"]
        _scale_drift(store, drifts)
        store.meta["wall_s"] = store.meta.get("wall_s", 0.0) + time.perf_counter() - started
        store.meta["interrupted"] = interrupted
        store.meta["load_average_1m_end"] = environment.load_average()
        df, _ = load_run(store.path)
        store.meta["peak_gflops"] = {f"{d}/{t}": float(v) for (d, t), v in
                                     df[df.status == "ok"].groupby(["device", "dtype"])["peak_gflops_per_s"].first().items()}
        store.meta["contended_cells"] = int(contention.contended_mask(df).sum())  # how much of the run was contended
        if hasattr(run_exec, "node_environments"):  # merged by node, so a resumed run keeps earlier nodes
            nodes = {n.get("ray_node_id"): n for n in store.meta.get("nodes", [])}
            nodes.update({n.get("ray_node_id"): n for n in run_exec.node_environments()})
            store.meta["nodes"] = list(nodes.values())
        store.write_meta()
        store.finalize(csv=csv)
        store.close()  # the run folder's lock: the run can be resumed from now on
    if profile and not interrupted:
        with torch_threads(sweep.settings.threads):
            _profile_cells(df, store.path)
    df, _ = load_run(store.path)
    df.attrs.update(run_dir=str(store.path), run_id=store.run_id, interrupted=interrupted)
    return df


def _process_order(round_index: int, processes: int) -> list[int]:
    """The processes of one round, rotated each round so that no process always measures first."""
    return [(round_index + i) % processes for i in range(processes)]


def _profile_cells(df: pd.DataFrame, run_dir: Path) -> None:
    """Profile every ok cell after timing (never while timing) into ``run_dir/profile``."""
    from attnbench.profiling import profile_cell, save_ops

    results = []
    ok = df[df.status == "ok"]
    # Profiling never flushes the cache: a cold cell profiles exactly like its warm twin, so profile one.
    ok = ok.sort_values("cache", key=lambda c: c != "warm").drop_duplicates([a for a in AXES if a != "cache"])
    for row in ok.to_dict("records"):
        cell = Cell(**{a: int(row[a]) if a in INT_AXES else row[a] for a in AXES})
        results.append(profile_cell(cell, logdir=Path(run_dir) / "profile" / "traces"))
    if results:
        save_ops(results, Path(run_dir) / "profile" / "ops.parquet")


def argv_for_meta() -> list[str]:
    """The command line as typed (``attnbench`` instead of the script path)."""
    return ["attnbench", *sys.argv[1:]]
