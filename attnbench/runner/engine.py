"""``attnbench run``: make a sweep, then start (or resume) a run session, measure it and finish it.

The engine behind the CLI, the Python API (``attnbench.run``), the asv suite and the Ray executor. What a run
does between the sweep and its table is :class:`~attnbench.runner.session.RunSession`'s.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from attnbench import registry
from attnbench.devices import cuda_available, parse_device, parse_device_type
from attnbench.errors import AttnbenchError, SweepError
from attnbench.measure import drift
from attnbench.measure.cpu_env import check_allocator
from attnbench.results.schema import AXES, INT_AXES, Cell
from attnbench.runner import budget, interrupts
from attnbench.runner.cell import torch_threads
from attnbench.runner.executors.base import Executor
from attnbench.runner.session import RunSession, cpu_env_meta, sweep_from_meta, sweep_to_dict  # noqa: F401  (public here)
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
    if all(sweep.lengths) and not named:  # issue 37: --lengths without --impl: the variable-length implementations
        takes = [n for n in sweep.impl if registry.get(n).varlen] or [n for n in registry.names() if registry.get(n).varlen]
        sweep = dataclasses.replace(sweep, impl=tuple(takes))
    if all(sweep.batch_spec) and not named:  # issue 48: --batch-spec without --impl: the caches and varlen classes
        def runs(n: str) -> bool:
            return bool(registry.get(n).varlen or registry.get(n).kv_cache)

        takes = [n for n in sweep.impl if runs(n)] or [n for n in registry.names() if runs(n)]
        sweep = dataclasses.replace(sweep, impl=tuple(sorted(takes, key=lambda n: n != "paged_sdpa")))  # the baseline
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


def make_executor(kind: str, settings: Settings, run_id: str, ray_address: str | None = None) -> Executor:
    """The executor called ``kind`` (``local``: measuring worker processes on this machine; ``inprocess``: this
    process, outside the controlled environment; ``ray``)."""
    check_settings(settings, kind)
    if kind == "inprocess":
        from attnbench.runner.executors.local import InProcessExecutor

        return InProcessExecutor(settings, run_id)
    if kind == "local":
        from attnbench.runner.executors.local import WorkerExecutor

        return WorkerExecutor(settings, run_id)
    if kind == "ray":
        try:
            from attnbench.runner.executors.ray import RayExecutor
        except ImportError as exc:
            raise AttnbenchError(f"--executor ray needs Ray: pip install 'attnbench[ray]' ({exc})") from exc
        return RayExecutor(settings, run_id, address=ray_address)
    raise SweepError(f"unknown executor {kind!r}; use local, inprocess or ray")


def check_settings(settings: Settings, executor: str = "local") -> None:
    """One clear error for measurement settings that cannot work (before anything runs)."""
    check_allocator(settings.cpu_allocator)
    budget.check_timeout(settings.cell_timeout_s)
    drift.check_setting(settings.drift)
    if isinstance(settings.processes, bool) or not isinstance(settings.processes, int) or settings.processes < 1:
        raise SweepError(f"--processes must be a whole number >= 1, got {settings.processes!r}")
    if isinstance(settings.rounds, bool) or not isinstance(settings.rounds, int) or settings.rounds < 1:
        raise SweepError(f"--rounds must be a whole number >= 1, got {settings.rounds!r}")
    if executor == "ray" and settings.processes > 1:
        raise SweepError("--processes applies to local runs; on Ray use --rounds (each task runs in a Ray worker)")


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
    registered only there), so calling this from a notebook measures like ``attnbench run``;
    ``executor="inprocess"`` measures here instead (for debugging), ``"ray"`` on a Ray cluster.
    ``resume`` continues the run folder it names, skipping cells already recorded.
    ``progress(i, n, cell, row)`` is called before (row None) and after each cell.
    Timing holds this machine's measurement lock (:mod:`attnbench.measure.machine_lock`): with another
    measurement running, the run waits (``no_wait``: raises instead; ``allow_concurrent``: measures anyway).
    The run folder is locked while this writes it (:mod:`attnbench.results.lock`).

    The returned DataFrame has ``attrs["run_dir"]``, ``attrs["run_id"]`` and ``attrs["interrupted"]``
    (True after Ctrl-C: every finished cell is kept and the results are consolidated before returning).
    """
    interrupted_by = None

    def executor_for(kind: str, run_settings: Settings, rid: str):
        return make_executor(kind, run_settings, rid, ray_address)

    if resume is not None:
        session = RunSession.resume(resume, executor=executor, make_executor=executor_for, sweep=sweep,
                                    settings=settings, progress=progress)
    else:
        if sweep is None:
            sweep = make_sweep(preset=preset, file=file, settings=settings, executor=executor, **axes)
        elif settings:
            sweep = dataclasses.replace(sweep, settings=dataclasses.replace(sweep.settings, **settings))
        session = RunSession.start(sweep, out=out, executor=executor, make_executor=executor_for, run_id=run_id,
                                   argv=argv, progress=progress)
    try:
        session.measure(lock="off" if allow_concurrent else "no-wait" if no_wait else "wait")
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (attnbench.runner.interrupts): every finished row is kept
        session.interrupted = True
        interrupted_by = interrupts.signal_of(exc)
    finally:
        with interrupts.deferred(deliver=not session.interrupted):  # a signal does not cut the consolidation short
            df = session.finish(csv=csv)
    df.attrs["interrupted_by"] = interrupted_by if session.interrupted else None
    if profile and not session.interrupted:
        with torch_threads(session.sweep.settings.threads):
            _profile_cells(df, session.store.path)
    return df


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
