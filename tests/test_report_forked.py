"""The report's forked drawing (attnbench.report.forked): the same value as drawing here, failures surface here, no
child is left waiting."""

from __future__ import annotations

import os
import time

import pytest

from attnbench.report import forked
from attnbench.report.forked import Forked

pytestmark = pytest.mark.skipif(not forked.can_fork(), reason="needs os.fork and two usable cores")


def test_the_child_computes_the_value_and_writes_its_files(tmp_path):
    def draw():
        (tmp_path / "a.txt").write_text(str(os.getpid()))
        return {"pid": os.getpid(), "squares": [i * i for i in range(5)]}

    job = Forked(draw)
    assert job.pid is not None
    value = job.result()
    assert value["squares"] == [0, 1, 4, 9, 16]
    assert value["pid"] != os.getpid() and (tmp_path / "a.txt").read_text() == str(value["pid"])


def test_an_error_in_the_child_is_raised_here_with_a_note(capsys):
    calls = []

    def draw():
        calls.append(os.getpid())
        raise ValueError("no such column: speedup")

    job = Forked(draw)
    with pytest.raises(ValueError, match="no such column"):
        job.result()
    assert calls == [os.getpid()]  # the parent's own attempt (the child's list is its own copy)
    assert "forked process failed: ValueError: no such column" in capsys.readouterr().err


def test_a_child_that_dies_without_answering_is_replaced_by_drawing_here(capsys):
    parent = os.getpid()
    job = Forked(lambda: os._exit(3) if os.getpid() != parent else "drawn here")
    assert job.result() == "drawn here"
    assert "no answer" in capsys.readouterr().err


def test_a_child_that_hangs_is_killed_at_its_timeout(capsys):
    parent = os.getpid()
    job = Forked(lambda: time.sleep(60) if os.getpid() != parent else "drawn here", timeout_s=0.5)
    t0 = time.monotonic()
    assert job.result() == "drawn here"
    assert time.monotonic() - t0 < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(job.pid, os.WNOHANG)  # reaped: nothing left behind
    assert "no answer within 0.5 s (killed)" in capsys.readouterr().err


def test_switched_off_it_draws_in_this_process(monkeypatch):
    monkeypatch.setenv(forked.ENV, "0")
    job = Forked(os.getpid)
    assert job.pid is None and job.result() == os.getpid()


def test_a_child_whose_result_is_never_asked_for_is_ended_and_reaped():
    import gc

    job = Forked(lambda: time.sleep(60))
    pid = job.pid
    del job
    gc.collect()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # killed and reaped, not left running or as a zombie
