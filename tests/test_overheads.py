"""Issue 30's fixed overheads: what a run does before and between its measurements, cut without changing a value."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

import attnbench.measure as measure
from attnbench import environment
from attnbench.runner.executors.warmup import settle_heap


class _Sample:
    def __init__(self, value):
        self.value, self.waited = value, False

    def result(self):
        self.waited = True
        return self.value


def test_collect_records_the_busy_sample_taken_alongside():
    sample = _Sample(0.42)
    meta = environment.collect(["attnbench", "run"], busy=sample)
    assert sample.waited and meta["cpu_busy_before_run"] == 0.42
    keys = list(meta)  # the key keeps its place in meta.json
    assert keys.index("cpu_busy_before_run") == keys.index("load_average_1m") + 1


def test_busy_sample_in_a_thread_gives_a_fraction():
    value = environment.BusySample(window_s=0.05).result()
    assert value is None or 0.0 <= value <= 1.0


def test_settled_heap_still_collects_what_is_made_afterwards():
    class Node:
        pass

    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_measure_names_resolve_lazily():
    assert measure.time_fn.__module__ == "attnbench.measure.timing"
    assert measure.paired_speedup.__module__ == "attnbench.measure.stats"
    assert set(measure.__all__) <= set(dir(measure))
    try:
        measure.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_starting_a_worker_imports_neither_scipy_nor_the_store():
    code = ("import sys; import attnbench.runner.executors.local, attnbench.measure.cpu_env, "
            "attnbench.measure.machine_lock, attnbench.runner.compile_cache, attnbench.results.schema; "
            "print(sorted(m for m in ('scipy.stats', 'attnbench.measure.stats', 'attnbench.results.store') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_which_command_lines_start_a_worker_ahead():
    from attnbench.runner.executors.ahead import default_worker_run

    assert default_worker_run(["/venv/bin/attnbench", "run"])
    assert default_worker_run(["/venv/bin/attnbench", "run", "--budget", "0.05", "--impl", "sdpa,weight_split"])
    assert not default_worker_run(["/venv/bin/attnbench", "check"])
    assert not default_worker_run(["/usr/bin/pytest", "run"])  # a test calling the CLI in-process
    for other in (["--threads", "2"], ["--cpu-allocator=system"], ["--no-cpu-bind"], ["--isolate"], ["--device", "cuda"],
                  ["--executor", "ray"], ["--resume", "results/x"], ["--preset", "long-context"], ["sweeps/a.toml"]):
        assert not default_worker_run(["/venv/bin/attnbench", "run", *other]), other


def test_the_run_takes_the_worker_started_ahead_only_when_its_environment_fits(monkeypatch):
    from attnbench.runner.executors import ahead, local
    from attnbench.runner.sweep import Settings

    monkeypatch.setattr(ahead, "_STARTED", None)
    monkeypatch.setattr(local, "_SHARED", None)  # as in the command (the test suite shares its workers)
    assert ahead.start_for(["/venv/bin/attnbench", "run"])
    early = ahead._STARTED.proc
    with local.prestarted(Settings(), ["cpu"]):
        (worker,) = next(iter(local._SHARED.idle.values()))
        assert worker.proc is early and ahead._STARTED is None
        worker.kill()
    assert ahead.start_for(["/venv/bin/attnbench", "run"])
    early = ahead._STARTED.proc
    assert ahead.take({**ahead._STARTED.env, "OMP_NUM_THREADS": "99"}, ahead.LABEL) is None  # another environment
    assert early.poll() is not None and ahead._STARTED is None  # ended, not left running


@pytest.mark.slow
def test_a_worker_leaves_cleanly_at_the_end_of_its_input():
    from attnbench.measure import cpu_env
    from attnbench.runner.executors.local import WorkerProcess

    worker = WorkerProcess(cpu_env.process_env(cpu_env.CpuEnv("pinned")), "test")
    assert worker.probe()["cpu_allocator"] == "pinned"
    worker.close()
    assert worker.proc.returncode == 0  # os._exit(0) after the last answer, not a kill after close()'s wait


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_a_name_resolves_in_a_process_that_never_imported_the_registry():
    """``import attnbench`` does not import the registry (PEP 562), nor does ``attnbench.resolve`` (issue 40: not even
    by name, so no import cycle); a name is resolved through ``attnbench.registry.resolve``, which loads it."""
    code = ("import sys\nimport attnbench\nfrom attnbench.resolve import resolve as bare\n"
            "from attnbench.results.schema import Cell\n"
            "assert 'attnbench.registry' not in sys.modules\n"
            "try:\n    bare('sdpa')\nexcept TypeError as exc:\n    assert 'attnbench.registry.resolve' in str(exc)\n"
            "else:\n    raise AssertionError('a name reached attnbench.resolve')\n"
            "assert 'attnbench.registry' not in sys.modules\n"
            "from attnbench.registry import resolve\n"
            "print(type(resolve('sdpa', Cell('sdpa', batch=1, seq_len=8, num_heads=2, d_model=8))).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() in ("Ready", "Skip")


def test_the_binomial_and_normal_quantiles_are_scipys():
    """The median CI's rank and the z value, from the standard library (SciPy's import cost each process 1.2-1.8 s),
    equal SciPy's own quantiles."""
    from scipy import stats as sstats

    from attnbench.measure.stats import binom_half_ppf, z_value

    for q in (0.005, 0.025, 0.05, 0.25):
        for n in [*range(1, 400), 999, 1000, 1001, 4095, 12_345, 20_000]:
            assert binom_half_ppf(q, n) == int(sstats.binom.ppf(q, n, 0.5)), (q, n)
    for confidence in (0.8, 0.9, 0.95, 0.99):
        assert z_value(confidence) == pytest.approx(float(sstats.norm.ppf(0.5 + confidence / 2)), rel=1e-12)
    with pytest.raises(ValueError, match="q must be"):
        binom_half_ppf(0.0, 10)


def test_the_measuring_and_summing_up_paths_do_not_import_scipy():
    code = ("import sys; import attnbench.cli.app, attnbench.cli.run, attnbench.runner.group, "
            "attnbench.runner.session, attnbench.measure.stats, attnbench.measure.drift, "
            "attnbench.measure.speedup_spread; print('scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
