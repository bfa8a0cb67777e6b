"""Issue 30: where a run's time goes (phases in meta.json, the console, the report), per-member stopping on the figure
the user reads, and torch.compile's caches kept per machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import attnbench
from attnbench.cli.app import cli
from attnbench.measure.interleave import time_interleaved
from attnbench.results.store import read_meta
from attnbench.runner import compile_cache, phases

FAST = {"budget_s": 0.05, "warmup_s": 0.0, "warmup_calls": 1, "min_samples": 3, "threads": 1}
TINY = dict(batch=[1], seq_len=[16], num_heads=[2], d_model=[16], mode=["inference"])


# ---------------------------------------------------------------- stopping on the figure the user reads


def test_a_member_whose_speedup_is_known_leaves_while_a_noisy_one_gets_the_cycles(synthetic_bursts):
    rng = np.random.default_rng(3)
    levels = np.exp(rng.normal(0, 0.3, 200))  # the machine's speed, one level per cycle
    jumps = np.exp(rng.normal(0, 0.5, 200))  # the noisy member's own luck, per cycle
    bursts = {"n": -4}  # on_burst sees the three warm-ups first (and counts before each burst)

    def level(of=levels) -> float:
        return float(of[max(bursts["n"], 0) // 3])

    def count(name: str) -> None:
        bursts["n"] += 1

    def base():  # the drift moves every member alike from cycle to cycle ...
        return 2e-3 * level()

    def quiet():  # ... so this member's ratio to the baseline is exactly 2, though its own median is far from known
        return 1e-3 * level()

    def noisy():  # and this one's ratio jumps
        return 1e-3 * level() * level(jumps)

    t = time_interleaved({"base": base, "quiet": quiet, "noisy": noisy}, warmup_calls=1, warmup_s=0.0, min_cycles=6,
                         max_cycles=40, budget_s=60, burst_s=2e-3, min_block_s=0.0, min_samples=3, baseline="base",
                         target_rel_ci=0.02, on_burst=count)
    assert t.member_stopped_by == {"base": "max_cycles", "quiet": "target", "noisy": "max_cycles"}
    assert t.member_cycles["quiet"] == 6 and t.member_cycles["noisy"] == t.member_cycles["base"] == t.cycles == 40
    assert t.speedup("quiet")[0] == pytest.approx(2.0)


def test_the_group_stops_when_every_figure_is_known(synthetic_bursts):
    t = time_interleaved({"base": lambda: 2e-3, "a": lambda: 1e-3}, warmup_calls=1, warmup_s=0.0, min_cycles=6,
                         max_cycles=1000, budget_s=60, burst_s=4e-3, min_block_s=0.0, min_samples=3, baseline="base")
    assert t.stopped_by == "ci" and t.cycles == 6
    assert t.member_stopped_by == {"base": "target", "a": "target"}
    assert set(t.warmup_s_spent) == {"base", "a"} and all(s >= 0 for s in t.warmup_s_spent.values())


# ---------------------------------------------------------------- the phases

def test_phases_add_up_to_the_wall_time_and_read_back_as_a_line_and_a_table():
    rows = [{"phase_build_s": 3.0, "compile_s": 2.0, "phase_warmup_s": 0.5, "phase_timed_s": 4.0, "phase_work_s": 1.0},
            {"phase_build_s": 1.0, "compile_s": math.nan, "phase_warmup_s": 0.5, "phase_timed_s": 4.0,
             "phase_work_s": None}]
    p = phases.account(rows, 20.0, workers_s=2.0, locks_s=1.5)
    assert p["building"] == 2.0 and p["compiling"] == 2.0 and p["warm-up"] == 1.0 and p["timed cycles"] == 8.0
    assert p["memory/FLOPs"] == 1.0 and p["workers"] == 2.0 and p["locks waited"] == 1.5
    assert p["bookkeeping"] == pytest.approx(2.5) and p["wall"] == 20.0
    assert sum(p[k] for k in phases.PHASES) == pytest.approx(p["wall"])
    done = phases.with_cli(p, startup_s=1.0, report_s=3.0)
    assert done["wall"] == 24.0 and done["report"] == 3.0 and done["start-up"] == 1.0
    assert phases.line(done).startswith("time: 24.0 s = start-up 1.0 s, workers 2.0 s, building 2.0 s")
    table = phases.table(done)
    assert [r["phase"] for r in table] == [*phases.PHASES, "wall"] and table[-1]["share"] == 1.0
    assert phases.merge(p, p)["wall"] == 40.0  # a resumed run adds its sessions


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    """A tiny run of one comparison group of three, two rounds."""
    return attnbench.run(impl=["weight_split", "einsum", "sdpa"], out=tmp_path_factory.mktemp("phases"),
                         settings={**FAST, "rounds": 2}, **TINY)


def test_a_run_records_its_phases_cycles_and_why_each_round_stopped(two_rounds):
    df = two_rounds
    meta = read_meta(df.attrs["run_dir"])
    p = meta["phases"]
    assert set(phases.PHASES) <= set(p) and p["timed cycles"] > 0 and p["building"] > 0 and p["memory/FLOPs"] > 0
    assert sum(p[k] for k in phases.PHASES) == pytest.approx(p["wall"], abs=0.01)
    assert p["wall"] == pytest.approx(df.attrs["session_wall_s"], abs=0.01)
    assert meta["compile_cache_dir"] == str(compile_cache.cache_dir()) or os.environ.get(compile_cache.ENV_DIR)
    for r in df.itertuples():
        assert r.status == "ok"
        assert r.cycles == int(np.isfinite(np.asarray(r.cycle_s, dtype=float)).sum()) > 0
        reasons = r.stopped_by.split(",")
        assert len(reasons) == 2 and set(reasons) <= {"target", "budget", "max_cycles"}
        assert r.phase_timed_s > 0 and r.phase_build_s > 0 and r.phase_warmup_s >= 0
        # the second round skipped the memory/FLOP pass (sweep.for_round); the merged row has the first round's
        assert math.isfinite(r.peak_bytes) and r.flops_counted > 0
    assert "rounds stopped by" in phases.stop_text(df.to_dict("records")) and "half-width: median" in phases.stop_text(
        df.to_dict("records"))


def test_only_the_first_round_measures_memory_and_counts_flops():
    from attnbench.runner.sweep import Settings, for_round

    s = Settings(rounds=3)
    assert for_round(s, 0) is s and for_round(s, 1).work_pass is False and for_round(s, 2).flop_check is True


def test_the_cli_prints_where_the_time_went(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--impl", "einsum,sdpa", "--seq", "16", "--batch", "1", "--heads", "2",
                                      "--d-model", "16", "--mode", "inference", "--budget", "0.05", "--out",
                                      str(tmp_path), "--no-report", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["time"].startswith("time: ") and "timed cycles" in out["time"] and "rounds stopped by" in out["time"]
    assert read_meta(out["run_dir"])["phases"]["report"] == 0.0


def test_the_report_has_the_phase_table(two_rounds):
    df = two_rounds
    time_df, sampling = phases.report_frames(read_meta(df.attrs["run_dir"]), df)
    assert list(time_df["phase"]) == [*phases.PHASES, "wall"]
    assert len(sampling) == 3 and all(set(s.split(",")) <= {"target", "budget", "max_cycles"} for s in sampling.stopped_by)
    empty_time, empty_sampling = phases.report_frames({}, df.drop(columns=["stopped_by"]))
    assert empty_time.empty and empty_sampling.empty  # a run before issue 30


# ---------------------------------------------------------------- torch.compile's caches

def test_the_measuring_processes_keep_compile_caches_per_torch_version(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = compile_cache.worker_env({}, "2.13.0+cpu")
    assert env[compile_cache.ENV_DIR] == str(tmp_path / "attnbench" / "inductor" / "2.13.0+cpu")
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    mine = compile_cache.worker_env({compile_cache.ENV_DIR: "/elsewhere", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    assert mine[compile_cache.ENV_DIR] == "/elsewhere" and mine["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"  # the user's


def test_cache_state_reads_hits_and_misses():
    assert compile_cache.state((0, 0), (2, 0)) == "warm"
    assert compile_cache.state((2, 0), (3, 1)) == "cold"
    assert compile_cache.state((1, 1), (1, 1)) == "" and compile_cache.state(None, (1, 0)) == ""


COMPILE_ONCE = """
import json, sys
from attnbench.runner import compile_cache
compile_cache.use_here()
from attnbench.results.schema import Cell
from attnbench.runner.cell import run_cell
from attnbench.runner.sweep import Settings
row = run_cell(Cell("compiled:einsum", batch=1, seq_len=8, num_heads=2, d_model=8, mode="inference"),
               Settings(budget_s=0.01, warmup_s=0.0, min_samples=3, flop_check=False, threads=1))
print(json.dumps({k: row[k] for k in ("status", "error", "compile_s", "compile_cache")}))
"""


@pytest.mark.slow
def test_a_second_compile_of_the_same_module_in_a_fresh_process_is_warm(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop(compile_cache.ENV_DIR, None)

    def once() -> dict:
        proc = subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second = once(), once()
    assert first["status"] == second["status"] == "ok", (first, second)
    assert first["compile_cache"] == "cold" and second["compile_cache"] == "warm"
    assert any((tmp_path / "attnbench" / "inductor").iterdir())


@pytest.mark.slow
def test_a_worker_started_ahead_is_the_one_the_run_measures_in(tmp_path, monkeypatch):
    from attnbench.runner.executors import local
    from attnbench.runner.sweep import Settings

    monkeypatch.setattr(local, "_SHARED", None)  # as in a command, not the test session's shared workers
    with local.prestarted(Settings(**FAST)):
        (ahead,) = [w for ws in local._SHARED.idle.values() for w in ws]
        df = attnbench.run(impl=["einsum", "sdpa"], out=tmp_path, settings=FAST, **TINY)
        assert ahead.proc.poll() is None  # given back to the block's pool, ended with it
    assert (df.status == "ok").all() and set(df.worker) == {f"process0 pid{ahead.pid}"}
    assert ahead.proc.poll() is not None
    with local.prestarted(Settings(**{**FAST, "isolate": True})):
        assert local._SHARED is None  # nothing started ahead of isolated cells


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_compile_may_use_the_drivers_cores_and_the_binding_comes_back():
    import torch._inductor.config as inductor_config

    before, threads = os.sched_getaffinity(0), inductor_config.compile_threads
    os.sched_setaffinity(0, {min(before)})  # bound to one core, as a measuring process is
    try:
        with compile_cache.all_cores() as cores:
            assert cores == os.sched_getaffinity(0) >= {min(before)}
            assert inductor_config.compile_threads == len(cores)
        assert os.sched_getaffinity(0) == {min(before)} and inductor_config.compile_threads == threads
    finally:
        os.sched_setaffinity(0, before)


def _clocked(monkeypatch, seed: int = 5):
    """A synthetic clock that each member's call advances by the per-call time it reports, and the members."""
    from attnbench.measure import interleave

    clock = {"t": 0.0}
    monkeypatch.setattr(interleave, "_clock", lambda: clock["t"])
    # the warm-up too reports the member's synthetic per-call time, so bursts are planned on the synthetic clock
    monkeypatch.setattr(interleave, "_warm_up", lambda fn, device, calls, warmup_s, between=None: (fn(), 1))
    rng = np.random.default_rng(seed)

    def member(per_call: float, noisy: bool = False):
        def fn() -> float:
            t = per_call * (float(np.exp(rng.normal(0, 0.5))) if noisy else 1.0)
            clock["t"] += t
            return t

        return fn

    return clock, member


@pytest.mark.parametrize("quiet_leaves", [True, False])
def test_time_a_member_leaves_unspent_is_saved_not_handed_to_the_others(synthetic_bursts, monkeypatch, quiet_leaves):
    """Each member's share of the group's budget is a ceiling: the cycles' time is split among the members in them, so
    when a quiet member leaves known, the group ends about its share sooner; with nobody leaving it is the budget."""
    clock, member = _clocked(monkeypatch)
    fns = {"base": member(2e-3), "quiet": member(1e-3, noisy=not quiet_leaves), "noisy": member(1e-3, noisy=True)}
    t = time_interleaved(fns, warmup_calls=1, warmup_s=0.0, min_cycles=6, max_cycles=100_000, budget_s=3.0,
                         burst_s=2e-3, min_block_s=0.0, min_samples=3, baseline="base", target_rel_ci=0.02,
                         pairing="adjacent")
    cycles_s = clock["t"] - 4e-3  # less the warm-up calls (at most 2 + 1 + 1 ms)
    assert t.stopped_by == "budget" and t.member_stopped_by["noisy"] == "budget"
    if quiet_leaves:
        assert t.member_stopped_by["quiet"] == "target" and t.member_cycles["quiet"] == 6
        assert 1.9 < cycles_s < 2.2  # the two members left had their shares (1 s each); the quiet one's was saved
    else:
        assert t.member_stopped_by["quiet"] == "budget"
        assert 2.95 < cycles_s < 3.1  # everyone's share: the whole budget
