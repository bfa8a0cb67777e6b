"""The run-folder lock (live, stale, another host), meta.json updated in place, duplicate cells dropped at
consolidation, and the machine-wide measurement lock (waiting, --no-wait, nesting, per GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from attnbench.errors import AttnbenchError
from attnbench.locks import Holder, LockFile
from attnbench.measure import machine_lock
from attnbench.results.lock import RUN_LOCK_NAME, RunLockedError, lock_run
from attnbench.results.schema import Cell, empty_row
from attnbench.results.store import RunStore, load_run
from tests.refusal_text import refusal_text  # a refusal: an error: headline, a few short indented lines

# Helper processes load the lock modules without the package's __init__ (which imports torch: seconds each on a
# loaded machine); the modules themselves are the real ones.
STUB = f"""
import sys, types
for name, sub in (("attnbench", ""), ("attnbench.results", "results"), ("attnbench.measure", "measure")):
    module = types.ModuleType(name)
    module.__path__ = [{str(Path(__file__).resolve().parent.parent / "attnbench")!r} + ("/" + sub if sub else "")]
    sys.modules[name] = module
"""
HOLD = STUB + """
import sys, time
from attnbench.results.lock import lock_run
lock = lock_run(sys.argv[1], purpose="a test holder")
print("locked", flush=True)
time.sleep(60)
"""


def _holder_process(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s run lock (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _write_record(path: Path, holder: Holder) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(holder.as_json())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it, far later)


def test_live_lock_is_refused_naming_its_holder(tmp_path):
    proc = _holder_process(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=rf"being written by pid {proc.pid} on host .*a test holder") as err:
            lock_run(tmp_path)
        assert isinstance(err.value, AttnbenchError) and "\n" not in str(err.value)  # one line, exit 2 in the CLI
    finally:
        proc.kill()
        proc.wait()


def test_lock_of_a_killed_process_is_taken_over_with_a_note(tmp_path):
    proc = _holder_process(tmp_path)
    proc.kill()  # SIGKILL: no chance to release; the kernel drops the flock, the record stays
    proc.wait()
    record = Holder.parse((tmp_path / RUN_LOCK_NAME).read_text())
    assert record is not None and record.pid == proc.pid
    lock = lock_run(tmp_path)
    try:
        assert lock.took_over.pid == proc.pid
        assert f"took over the run lock of pid {proc.pid}" in lock.takeover_note()
        assert Holder.parse((tmp_path / RUN_LOCK_NAME).read_text()).pid == os.getpid()  # ours now
    finally:
        lock.release()
    assert not (tmp_path / RUN_LOCK_NAME).exists()  # a clean release removes the file (issue 40: no empty .lock)
    again = lock_run(tmp_path)
    assert again.took_over is None  # ... so the next holder takes it over from nobody
    again.release()


def test_a_lock_file_removed_by_its_holder_is_not_locked_through_a_stale_descriptor(tmp_path):
    path = tmp_path / "x.lock"
    first = LockFile(path)
    assert first.try_acquire()
    stale = os.open(path, os.O_RDWR)  # a second process opened the file before the holder let go
    first.release(remove=True)
    assert not path.exists()
    assert not LockFile(path)._same_file(stale)  # so a lock on it would guard nothing: try_acquire opens anew
    os.close(stale)
    second = LockFile(path)
    assert second.try_acquire() and path.exists() and second._same_file(second.fileno())
    second.release()
    assert path.exists() and path.read_text() == ""  # without remove=True (the machine lock's files) the file stays


def test_a_finished_run_keeps_no_lock_file(tmp_path):
    with RunStore(tmp_path, run_id="r") as store:
        assert (store.path / RUN_LOCK_NAME).exists()  # held while writing
    assert not (tmp_path / "r" / RUN_LOCK_NAME).exists()


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    other = Holder(pid=1234, host="some-other-host.example", started_at="2026-12-01T10:00:00+00:00", command="attnbench run")
    _write_record(tmp_path / RUN_LOCK_NAME, other)
    with pytest.raises(RunLockedError, match=r"on another host.*delete .*\.lock"):
        lock_run(tmp_path)
    assert Holder.parse((tmp_path / RUN_LOCK_NAME).read_text()) == other  # its record is left alone


def test_store_refuses_a_second_writer_and_a_resume_while_live(tmp_path):
    store = RunStore(tmp_path, run_id="r1", meta={"command": "test"})
    try:
        with pytest.raises(RunLockedError, match="being written by pid"):
            RunStore(tmp_path / "r1", resume=True)
        with pytest.raises(RunLockedError, match="being written by pid"):
            RunStore(tmp_path, run_id="r1", meta={})  # the same --run-id
    finally:
        store.close()
    RunStore(tmp_path / "r1", resume=True).close()  # released: resumable


def test_store_takes_over_a_dead_writers_lock_and_notes_it_in_meta(tmp_path, capsys):
    store = RunStore(tmp_path, run_id="r1", meta={"command": "test"})
    store.close()
    dead = Holder(pid=_dead_pid(), host=Holder.me().host, started_at="2026-12-01T10:00:00+00:00")
    _write_record(tmp_path / "r1" / RUN_LOCK_NAME, dead)
    resumed = RunStore(tmp_path / "r1", resume=True)
    resumed.close()
    meta = json.loads((tmp_path / "r1" / "meta.json").read_text())
    assert f"pid {dead.pid}" in meta["lock_takeovers"][0]
    assert f"took over the run lock of pid {dead.pid}" in capsys.readouterr().err


def test_meta_is_updated_in_place_not_overwritten(tmp_path):
    store = RunStore(tmp_path, run_id="r1", meta={"command": "test", "wall_s": 30.0})
    meta_file = tmp_path / "r1" / "meta.json"
    other = json.loads(meta_file.read_text())
    other["added_by_someone_else"] = 1  # e.g. a tool annotating the run meanwhile
    meta_file.write_text(json.dumps(other))
    store.meta["drift"] = {"cpu": 0.02}
    store.write_meta()
    on_disk = json.loads(meta_file.read_text())
    assert on_disk["added_by_someone_else"] == 1 and on_disk["drift"] == {"cpu": 0.02} and on_disk["wall_s"] == 30.0
    del store.meta["drift"]
    store.write_meta()
    assert "drift" not in json.loads(meta_file.read_text())
    store.close()


def _row(cell: Cell, status: str = "ok", groups: int = 1, n: int = 10) -> dict:
    row = empty_row(cell, "r1")
    row.update(status=status, n=n, samples_s=[1e-3] * n, sample_groups=[n // groups] * groups, median_s=1e-3)
    return row


def test_consolidation_keeps_the_complete_row_and_says_what_it_dropped(tmp_path, capsys):
    a, b = Cell("sdpa", seq_len=64), Cell("einsum", seq_len=64)
    store = RunStore(tmp_path, run_id="r1", meta={"command": "test"})
    store.append(_row(a, groups=2, n=20))  # both rounds merged
    partial = store.append(_row(a, groups=1, n=10))  # a second writer's row of the same cell
    failed = store.append(_row(b, status="error", n=0))
    store.append(_row(b))
    df, _ = load_run(store.path)
    assert len(df) == 2 and set(df.cell_id) == {a.cell_id, b.cell_id}  # readers see one row per cell already
    assert df.set_index("cell_id").loc[a.cell_id, "n"] == 20 and df.set_index("cell_id").loc[b.cell_id, "status"] == "ok"
    store.finalize()
    store.close()
    final = pd.read_parquet(store.path / "results.parquet")
    assert sorted(final.cell_id) == sorted([a.cell_id, b.cell_id])
    assert {p.name for p in (store.path / "cells" / "duplicates").iterdir()} == {partial.name, failed.name}  # kept aside
    err = capsys.readouterr().err
    assert f"two rows for {a.cell_id}" in err and partial.name in err
    meta = json.loads((store.path / "meta.json").read_text())
    assert {d["file"] for d in meta["dropped_duplicates"]} == {partial.name, failed.name}


def test_append_numbers_cells_by_a_counter(tmp_path, monkeypatch):
    store = RunStore(tmp_path, run_id="r1", meta={"command": "test"})
    store.append(_row(Cell("sdpa")))
    monkeypatch.setattr(Path, "glob", lambda *a, **k: pytest.fail("append listed the cells folder"))
    second = store.append(_row(Cell("einsum")))
    assert second.name.startswith("00001-")
    monkeypatch.undo()
    store.close()
    resumed = RunStore(tmp_path / "r1", resume=True)  # the counter continues after the cells already there
    assert resumed.append(_row(Cell("wrapper"))).name.startswith("00002-")
    resumed.close()


# --------------------------------------------------------------------------------------------------
# the machine lock


def test_lock_dir_comes_from_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(machine_lock.ENV_DIR, str(tmp_path / "L"))
    assert machine_lock.lock_dir() == tmp_path / "L"
    monkeypatch.delenv(machine_lock.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert machine_lock.lock_dir() == tmp_path / "cache" / "attnbench" / "locks"


def test_cpu_takes_the_host_exclusively_gpus_share_it_and_lock_their_own(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    files = machine_lock.lock_files(["cuda:1", "cuda"])
    assert [f.shared for f in files] == [True, False, False]
    assert [f.path.name.rsplit("-", 1)[-1] for f in files[1:]] == ["3.lock", "5.lock"]  # physical GPUs
    mixed = machine_lock.lock_files(["cpu", "cuda:0"])
    assert mixed[0].shared is False and len(mixed) == 2


HOLD_MACHINE = STUB + """
import sys, time
from attnbench.measure import machine_lock
held = machine_lock.acquire(sys.argv[1].split(","), purpose="a test measurement")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
held.release()
"""


def _machine_holder(devices: str = "cpu", seconds: float = 60) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_MACHINE, devices, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_measurement_waits_says_for_whom_and_how_long():
    proc = _machine_holder(seconds=1.0)
    said: list[str] = []
    try:
        started = time.monotonic()
        held = machine_lock.acquire(["cpu"], say=said.append, poll_s=0.05)
        waited = time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()
    held.release()
    assert f"pid {proc.pid}" in said[0] and "a test measurement" in said[0] and said[0].startswith("waiting")
    assert sum(m.startswith("waiting") for m in said) == 1  # said once per holder, not at every poll
    assert said[-1].startswith("waited ") and held.waited_s > 0.2 and held.waited_s <= waited
    meta: dict = {}
    machine_lock.record(meta, held)
    assert meta["machine_lock_waited_s"] == pytest.approx(held.waited_s, abs=1e-3)
    assert f"pid {proc.pid}" in meta["machine_lock"][0]["waited_for"][0]


def test_no_wait_fails_at_once_and_allow_concurrent_skips_the_lock():
    proc = _machine_holder()
    try:
        with pytest.raises(machine_lock.MachineBusyError, match=rf"pid {proc.pid}.*--allow-concurrent"):
            machine_lock.acquire(["cpu"], policy="no-wait")
        held = machine_lock.acquire(["cpu"], policy="off")
        assert held.locks == [] and held.as_meta()["policy"] == "off"
        # a measurement on a GPU shares the host with other GPUs, never with a CPU measurement
        with pytest.raises(machine_lock.MachineBusyError):
            machine_lock.acquire(["cuda:0"], policy="no-wait")
    finally:
        proc.kill()
        proc.wait()


def test_measurements_on_different_gpus_run_side_by_side_but_not_on_the_same_one():
    proc = _machine_holder("cuda:0")
    try:
        other_gpu = machine_lock.acquire(["cuda:1"], policy="no-wait")
        other_gpu.release()
        with pytest.raises(machine_lock.MachineBusyError, match=rf"pid {proc.pid}"):
            machine_lock.acquire(["cuda:0"], policy="no-wait")
        with pytest.raises(machine_lock.MachineBusyError, match=rf"pid {proc.pid}"):  # named through its GPU lock
            machine_lock.acquire(["cpu"], policy="no-wait")
    finally:
        proc.kill()
        proc.wait()


def test_a_child_of_the_holder_measures_under_its_lock():
    held = machine_lock.acquire(["cpu"])
    try:
        code = STUB + ("from attnbench.measure import machine_lock; h = machine_lock.acquire(['cpu'], policy='no-wait'); "
                "print(h.under)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"pid {os.getpid()}" in out.stdout
        again = machine_lock.acquire(["cpu"], policy="no-wait")  # the holder itself asks again: no wait for itself
        assert again.under == "this process" and again.locks == []
        again.release()
    finally:
        held.release()
    assert not os.environ.get(machine_lock.HELD_ENV)
    machine_lock.acquire(["cpu"], policy="no-wait").release()  # and once released, it is really free


def test_a_killed_holder_frees_the_machine():
    proc = _machine_holder()
    proc.kill()
    proc.wait()
    machine_lock.acquire(["cpu"], policy="no-wait").release()


def test_lockfile_shared_holders_coexist(tmp_path):
    a, b = LockFile(tmp_path / "x.lock", shared=True), LockFile(tmp_path / "x.lock", shared=True)
    assert a.try_acquire() and b.try_acquire()
    assert not LockFile(tmp_path / "x.lock").try_acquire()
    a.release()
    b.release()
    assert LockFile(tmp_path / "x.lock").try_acquire()


@pytest.mark.slow
def test_runs_started_together_measure_one_after_the_other(tmp_path):
    """The engine holds the machine lock while timing: a run that starts while another times waits for it."""
    import attnbench

    kw = dict(impl=["sdpa"], seq_len=[32], batch=[1], num_heads=[2], d_model=[32], mode=["inference"],
              settings={"budget_s": 0.05, "min_samples": 3, "warmup_calls": 1, "warmup_s": 0.0, "drift": 0.0})
    proc = _machine_holder(seconds=1.5)
    result: dict = {}

    def second() -> None:
        result["df"] = attnbench.run(out=tmp_path, **kw)

    t = threading.Thread(target=second)
    t.start()
    t.join(timeout=240)
    proc.wait()
    df = result["df"]
    meta = json.loads((Path(df.attrs["run_dir"]) / "meta.json").read_text())
    assert meta["machine_lock_waited_s"] > 0.3 and f"pid {proc.pid}" in meta["machine_lock"][0]["waited_for"][0]
    assert len(df) == 1 and df.status.iloc[0] == "ok"


def test_cli_resume_of_a_live_run_and_no_wait_exit_2_with_one_line(tmp_path, capsys):
    from attnbench.cli import main

    store = RunStore(tmp_path, run_id="live", meta={"command": "test", "sweep": {}})
    try:
        with pytest.raises(SystemExit) as exc:
            main(["run", "--resume", str(store.path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "being written by pid" in refusal_text(err)
    finally:
        store.close()
    proc = _machine_holder()
    try:
        with pytest.raises(SystemExit) as exc:
            main(["run", "--impl", "sdpa", "--seq", "16", "--heads", "2", "--d-model", "16", "--out", str(tmp_path / "r"),
                  "--no-wait", "-q", "--no-report"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        text = refusal_text(err[err.index("error: "):])
        assert text.startswith("error: another measurement is running") and f"pid {proc.pid}" in text
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-wait", "--allow-concurrent"])
    assert exc.value.code == 2


def test_a_ray_cell_notes_its_wait():
    held = machine_lock.Held("wait", waited_s=3.2, waited_for=["pid 1 on host h since t: attnbench run"])
    row = held.annotate({"notes": "sampling stopped by ci"})
    assert row["notes"] == ("sampling stopped by ci; waited 3.2 s for this node's measurement lock "
                            "(pid 1 on host h since t: attnbench run)")
    assert machine_lock.Held("wait").annotate({"notes": ""})["notes"] == ""


def test_an_abandoned_store_releases_its_lock_cleanly(tmp_path, capsys):
    store = RunStore(tmp_path, run_id="r1", meta={"command": "test"})
    path = store.path
    del store  # never closed (a test, or an exception on the way): collected, its lock released
    RunStore(path, resume=True).close()
    assert "took over" not in capsys.readouterr().err


HOLD_WITH_WORKER = STUB + """
import subprocess, sys, time
from attnbench.measure import machine_lock
held = machine_lock.acquire(["cpu"], purpose="a driver")
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=held.fds())
print(worker.pid, flush=True)
time.sleep(60)
"""


def test_a_worker_given_the_descriptors_keeps_the_machine_locked_after_its_driver_is_killed():
    driver = subprocess.Popen([sys.executable, "-c", HOLD_WITH_WORKER], stdout=subprocess.PIPE, text=True)
    worker = int(driver.stdout.readline())
    try:
        driver.kill()  # SIGKILL: the driver's descriptors close, the worker's keep the flock
        driver.wait()
        with pytest.raises(machine_lock.MachineBusyError):
            machine_lock.acquire(["cpu"], policy="no-wait")
    finally:
        os.kill(worker, 9)
    deadline = time.monotonic() + 10
    while True:  # the worker gone, the machine is free
        try:
            machine_lock.acquire(["cpu"], policy="no-wait").release()
            break
        except machine_lock.MachineBusyError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
