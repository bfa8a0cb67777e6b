"""Issue 28: no hang, no orphan, no memory blow-up. Cell and case timeouts, the cost and memory prediction and its
guard, OOM kills told apart from other kills, SIGTERM/SIGHUP like Ctrl-C, workers that die with their driver."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from attnbench import cli
from attnbench.errors import SweepError
from attnbench.measure import oom
from attnbench.results.schema import Cell
from attnbench.runner import budget, interrupts
from attnbench.runner.executors import orphans
from attnbench.runner.group import measure_unit
from attnbench.runner.sweep import Settings

REPO = Path(__file__).resolve().parent.parent
HANGS = "tests/plugins/faulty.py:HangsAWhile"
FAST = Settings(budget_s=0.05, warmup_s=0.0, min_samples=3, flop_check=False, threads=1)
TINY = dict(batch=1, seq_len=16, num_heads=2, d_model=16, mode="forward")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        cli.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- timeouts: parsing and the flags


def test_timeout_text_is_seconds_auto_or_none_and_zero_is_refused():
    assert budget.parse_timeout("none") is None and budget.parse_timeout("OFF") is None
    assert budget.parse_timeout("auto") == "auto" and budget.parse_timeout("2.5") == 2.5
    for bad in ("0", "-3", "soon", "inf"):
        with pytest.raises(SweepError, match="--cell-timeout"):
            budget.parse_timeout(bad)
    with pytest.raises(SweepError, match="not a number of seconds > 0"):
        budget.check_timeout(0)


@pytest.mark.parametrize("argv", [["run", "--impl", "sdpa", "--cell-timeout", "0"],
                                  ["check", "--impl", "sdpa", "--case-timeout", "0"],
                                  ["check", "--impl", "sdpa", "--timeout", "0"]])
def test_a_zero_timeout_is_one_line_and_exit_2(argv, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and "Traceback" not in err
    flag = "--cell-timeout" if argv[0] == "run" else "--case-timeout"  # --timeout is check's short spelling
    assert err.strip().splitlines() == [f"error: {flag} '0': a timeout must be > 0 seconds; use {flag} none "
                                        "for no timeout"]


def test_check_fails_a_hanging_case_naming_its_timeout_and_skips_the_rest(repo_cwd, single_thread, capsys):
    code, out, _ = run_cli(["check", "--impl", HANGS, "--timeout", "0.5", "--kind", "forward,causality"], capsys)
    assert code == 1
    errors = [line for line in out.splitlines() if line.strip().startswith("ERROR")]
    assert len(errors) == 1 and "timeout: forward book_hd1 float64 exceeded its timeout of 0.5 s" in errors[0], out
    assert f"{HANGS}: FAIL (1 failed: forward; 0 passed," in out


def test_a_constructor_that_hangs_is_stopped_at_setup_naming_its_line(repo_cwd, single_thread, capsys):
    """Building and probing a plug-in before any case runs is bounded too: one refusal, exit 2, at the line it hung."""
    target = "tests/plugins/faulty.py:HangsInConstructor"
    started = time.monotonic()
    code, out, err = run_cli(["check", target, "--timeout", "1"], capsys)
    assert code == 2 and "Traceback" not in err, (out, err)
    line = next(n for n, text in enumerate((REPO / "tests/plugins/faulty.py").read_text().splitlines(), 1)
                if "# HANGS HERE" in text)
    assert f"{target} did not finish its setup" in err and f"stopped at tests/plugins/faulty.py:{line} " in err, err
    assert time.monotonic() - started < 60


# ---------------------------------------------------------------- the prediction, the default timeout, the guard


def test_a_tiny_cell_gets_the_floor_and_records_it(monkeypatch):
    plan = budget.plan_cell(Cell("sdpa", **TINY), FAST, 100.0, guard=lambda: pytest.fail("calibrated a tiny cell"))
    assert plan.timeout_s == budget.FLOOR_S and plan.skip is None and plan.announcement() is None
    assert math.isnan(plan.predicted_peak_bytes) and 0 < plan.predicted_s < 5
    compiled = budget.plan_cell(Cell("compiled:sdpa", **TINY), FAST, 100.0, guard=lambda: None)
    assert compiled.timeout_s == budget.COMPILED_FLOOR_S
    given = budget.plan_cell(Cell("sdpa", **TINY), Settings(cell_timeout_s=7.0), 100.0, guard=lambda: None)
    off = budget.plan_cell(Cell("sdpa", **TINY), Settings(cell_timeout_s=None), 100.0, guard=lambda: None)
    assert given.timeout_s == 7.0 and off.timeout_s is None
    (row,) = measure_unit([Cell("weight_split", **TINY)], FAST, "run", peak_gflops_per_s=100.0)
    assert row["status"] == "ok" and row["timeout_s"] == budget.FLOOR_S and row["predicted_s"] > 0


def test_a_long_cell_is_announced_and_its_timeout_scales(monkeypatch):
    import contextlib

    cell = Cell("sdpa", batch=8, seq_len=32768, num_heads=12, d_model=768)
    plan = budget.plan_cell(cell, FAST, 100.0, guard=contextlib.nullcontext)
    assert plan.predicted_s > budget.LONG_S and plan.timeout_s == pytest.approx(budget.SAFETY * plan.predicted_s)
    assert "extrapolated from T=256 and 512 at batch 1" in plan.how
    assert plan.announcement().startswith(f"{cell.cell_id}: predicted to take ~")


def test_a_cell_that_cannot_fit_is_a_skipped_row_with_the_numbers(monkeypatch):
    import contextlib

    monkeypatch.setattr(budget, "available_bytes", lambda device: (2.0 * 2**30, "MemAvailable"))
    cell = Cell("weight_split", batch=2, seq_len=4096, num_heads=8, d_model=64)  # 3 x 1 GiB of scores at least
    plan = budget.plan_cell(cell, FAST, 100.0, guard=contextlib.nullcontext)
    assert plan.predicted_peak_bytes > 3 * 2**30
    assert plan.skip.startswith("predicted to need ~") and "2 GiB available (MemAvailable;" in plan.skip
    assert "--no-memory-guard runs it anyway" in plan.skip
    unguarded = budget.plan_cell(cell, Settings(memory_guard=False), 100.0, guard=contextlib.nullcontext)
    assert unguarded.skip is None
    (row,) = measure_unit([cell], FAST, "run", peak_gflops_per_s=100.0)
    assert row["status"] == "skipped" and row["error"] == plan.skip and math.isnan(row["median_s"])
    assert row["predicted_peak_bytes"] == pytest.approx(plan.predicted_peak_bytes, rel=0.5)
    assert row["available_bytes"] == 2.0 * 2**30


def test_calibration_fits_the_growth_of_each_implementation():
    fit = budget._fit((256, 512), (3 * 256 + 5 * 256**2, 3 * 512 + 5 * 512**2), (0, 0), quadratic=True)
    assert fit == pytest.approx((3, 5))
    assert budget._fit((256, 512), (1000.0, 2000.0), (0, 0), quadratic=True) == pytest.approx((1000 / 256, 0))
    assert budget._fit((1, 2), (0.5, 0.7), (10.0, 30.0), quadratic=False) == pytest.approx((0.4, 0.01))


# ---------------------------------------------------------------- OOM kills: what the kernel's counters prove


def test_an_oom_kill_is_told_from_another_kill(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/user.slice/run.scope\n")
    scope = tmp_path / "cg" / "user.slice" / "run.scope"
    scope.mkdir(parents=True)
    (scope / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    (tmp_path / "vmstat").write_text("pgfault 10\noom_kill 7\n")
    files = oom.counter_files(proc, tmp_path / "cg", tmp_path / "vmstat")
    before = oom.snapshot(files)
    assert before == {str(tmp_path / "vmstat"): 7, str(scope / "memory.events"): 1}
    (scope / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    after = oom.snapshot(files)
    why = oom.explain(-signal.SIGKILL, before, after)
    assert oom.is_oom(why) and "memory.events oom_kill 1 -> 2" in why
    assert "not by the OOM killer" in oom.explain(-signal.SIGKILL, before, before)
    assert "perhaps the kernel's OOM killer" in oom.explain(-signal.SIGKILL, {}, {})
    assert oom.explain(-signal.SIGSEGV, before, after) is None and oom.explain(3, before, after) is None


# ---------------------------------------------------------------- signals and orphans


def test_sigterm_and_sighup_raise_like_ctrl_c_with_their_exit_status():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        interrupts.install()
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129)):
            if saved[sig] is signal.SIG_IGN:  # e.g. under nohup: a signal the parent ignores stays ignored
                assert signal.getsignal(sig) is signal.SIG_IGN
                continue
            with pytest.raises(KeyboardInterrupt) as caught:
                os.kill(os.getpid(), sig)
                time.sleep(1)
            assert isinstance(caught.value, interrupts.Terminated) and interrupts.exit_code(caught.value.signum) == code
        with pytest.raises(interrupts.Terminated):  # held back while a run writes its folder, then delivered
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
                finished = True
        assert finished
        with interrupts.deferred(deliver=False):  # already stopping: a second signal is dropped
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _fake_worker(driver_pid: int) -> subprocess.Popen:
    """A process whose command line is a measuring worker's (without importing torch)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", orphans.WORKER_MODULE, "process0",
                             str(driver_pid)], start_new_session=True)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_an_orphaned_worker_is_found_ended_and_named():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan, mine = _fake_worker(dead.pid), _fake_worker(os.getpid())  # mine: its driver (this process) is alive
    try:
        time.sleep(0.3)
        said: list[str] = []
        assert orphans.end_orphans(said.append) == [orphan.pid]
        assert orphan.wait(timeout=10) == -signal.SIGKILL and mine.poll() is None
        assert said == [f"note: ended an orphaned attnbench measuring worker (pid {orphan.pid}); its driver (pid "
                        f"{dead.pid}) is gone, and it would have measured beside this run"]
    finally:
        for p in (orphan, mine):
            p.kill()
            p.wait()


# ---------------------------------------------------------------- through the CLI, in processes of their own


def _workers_of(driver_pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if orphans.WORKER_MODULE in args and str(driver_pid) in args:
                found.append(int(entry.name))
    return found


def _attnbench(args: list[str], tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "attnbench", "run", *args, "--out", str(tmp_path), "--no-report",
                             "-q", "--allow-concurrent"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for_worker(proc: subprocess.Popen, timeout_s: float = 240) -> list[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        workers = _workers_of(proc.pid)
        if workers:
            return workers
        time.sleep(0.2)
    pytest.fail(f"no measuring worker appeared: {proc.communicate()}")


LONG_SWEEP = ["--impl", "weight_split", "--batch", "1..40+1", "--seq", "32", "--heads", "2", "--d-model", "16",
              "--budget", "0.5", "--threads", "1"]


@pytest.mark.slow
def test_a_hanging_member_times_out_and_the_group_keeps_its_measured_rows(tmp_path):
    proc = _attnbench(["--impl", f"sdpa,{HANGS}", "--batch", "1", "--seq", "32", "--heads", "2", "--d-model", "16",
                       "--budget", "0.1", "--threads", "1", "--cell-timeout", "3"], tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "1 of 2 cells failed (1 timeout)" in err, err  # a timeout fails the run (exit 1)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    df = pd.read_parquet(run_dir / "results.parquet").set_index("impl")
    assert df.loc[HANGS, "status"] == "timeout" and "exceeded its timeout of 3 s" in df.loc[HANGS, "error"]
    assert df.loc["sdpa", "status"] == "ok" and df.loc["sdpa", "median_s"] > 0 and df.loc["sdpa", "n"] > 0
    assert (df["timeout_s"] == 3.0).all() and len(list((run_dir / "cells").iterdir())) == 2


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_sigterm_keeps_the_rows_says_one_line_exits_143_and_leaves_no_worker(tmp_path):
    proc = _attnbench(LONG_SWEEP, tmp_path)
    _wait_for_worker(proc)
    end = time.monotonic() + 240
    # the first rows are stored: a whole cell file (a `.parquet.tmp` still being written is not a row yet, and
    # SIGTERM then would leave none: the flake seen in CI)
    while time.monotonic() < end and not list(tmp_path.glob("*/cells/*.parquet")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("terminated by SIGTERM: ") and "Traceback" not in err, err
    kept = int(lines[-1].split(": ")[1].split()[0])
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert kept >= 1 and len(pd.read_parquet(run_dir / "results.parquet")) == kept
    time.sleep(5)
    assert _workers_of(proc.pid) == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_worker_dies_with_a_sigkilled_driver(tmp_path):
    proc = _attnbench(LONG_SWEEP, tmp_path)
    workers = _wait_for_worker(proc)
    proc.kill()
    proc.communicate(timeout=60)
    time.sleep(5)
    assert [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text()
            .rpartition(")")[2].split()[:1]] == []


@pytest.mark.slow
def test_a_worker_sigkilled_while_the_kernel_counted_an_oom_kill_is_an_oom_row(repo_cwd, monkeypatch):
    """The driver's reading of the counters is faked (this test must not exhaust a shared machine's memory); the
    other verdicts are in test_an_oom_kill_is_told_from_another_kill."""
    from attnbench.runner.executors.local import WorkerExecutor

    counts = iter(range(100))
    monkeypatch.setattr(oom, "snapshot", lambda: {"/proc/vmstat": next(counts)})
    status, words = "oom", "killed by the kernel's OOM killer (SIGKILL while /proc/vmstat oom_kill"
    executor = WorkerExecutor(FAST, "run")
    try:
        row = executor.run_one(Cell("tests/plugins/faulty.py:KilledInForward", **TINY))
    finally:
        executor.close()
    assert row["status"] == status and "worker process died with SIGKILL" in row["error"] and words in row["error"]
