"""`attnbench run` end to end: rows for every cell, statuses for every fault, resume, Ctrl-C, isolation."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest

import attnbench
from attnbench.errors import ResultsError
from attnbench.results.schema import COLUMNS
from attnbench.results.store import load_run

PLUGINS = Path(__file__).parent / "plugins" / "faulty.py"
TINY = dict(batch=[1], seq_len=[16], num_heads=[2], d_model=[16], mode=["forward"])
FAST = {"budget_s": 0.05, "warmup_s": 0.0, "min_samples": 3, "flop_check": False}


def plugin(name):
    return f"{PLUGINS}:{name}"


def run_tiny(tmp_path, impls, **kw):
    settings = {**FAST, **kw.pop("settings", {})}
    return attnbench.run(impl=impls, out=tmp_path, settings=settings, **{**TINY, **kw})


def test_rows_have_the_full_schema_and_raw_samples(tmp_path):
    df = run_tiny(tmp_path, ["weight_split", "sdpa"], mode=["inference", "forward", "forward+backward"])
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == 6 and set(df.status) == {"ok"}
    for r in df.itertuples():
        assert r.n == len(r.samples_s) >= 3
        assert r.ci_low_s <= r.median_s <= r.ci_high_s
        assert r.peak_bytes > 0 and r.flops > 0 and r.gflops_per_s > 0 and 0 < r.frac_peak
        assert r.threads >= 1 and r.host and r.started_at
    run_dir = Path(df.attrs["run_dir"])
    meta = json.loads((run_dir / "meta.json").read_text())
    for key in ("timestamp", "command", "git_commit", "torch_version", "python_version", "cpu_model", "hostname",
                "torch_threads", "sweep", "peak_gflops"):
        assert key in meta
    assert (run_dir / "results.parquet").is_file()
    reread, _ = load_run(run_dir / "results.parquet")
    assert reread.cell_id.tolist() == df.cell_id.tolist()


def test_fault_statuses(tmp_path):
    impls = ["weight_split", plugin("Raises"), plugin("ImpossibleAllocation"), plugin("ReturnsNaN"),
             plugin("WrongShape"), plugin("Hangs")]
    df = run_tiny(tmp_path, impls, settings={"cell_timeout_s": 2.0}).set_index("impl")
    assert df.loc["weight_split", "status"] == "ok"
    assert df.loc[plugin("Raises"), "status"] == "error"
    assert "deliberate failure in forward" in df.loc[plugin("Raises"), "error"]
    assert df.loc[plugin("ImpossibleAllocation"), "status"] == "oom"
    assert df.loc[plugin("ReturnsNaN"), "status"] == "invalid"
    assert "non-finite" in df.loc[plugin("ReturnsNaN"), "error"]
    assert df.loc[plugin("WrongShape"), "status"] == "invalid"
    assert df.loc[plugin("Hangs"), "status"] == "timeout"
    bad = df[df.status != "ok"]
    assert bad.median_s.isna().all() and (bad.n == 0).all()  # a failed cell never reports a time


def test_a_hang_under_a_probe_or_a_swallowing_except_is_a_timeout_ended_in_process(tmp_path):
    """A forward that hangs while the form probes of its build call it (CI saw the cell's alarm turned into a
    PluginLoadError ``error`` row under load, and here the probes' ``except`` swallowed it until the worker was killed)
    and a forward that swallows the first alarm both end as ``timeout`` rows by the cell's own alarm, not by killing
    the worker after the grace."""
    impls = [plugin("Hangs"), plugin("SwallowsTimeouts")]
    df = run_tiny(tmp_path, impls, settings={"cell_timeout_s": 1.0}).set_index("impl")
    for impl in impls:
        assert df.loc[impl, "status"] == "timeout", df.loc[impl, "error"]
        assert "did not stop" not in df.loc[impl, "error"]  # the alarm ended it; the worker was not killed


def test_invalid_combinations_are_skipped_rows_not_crashes(tmp_path):
    df = run_tiny(tmp_path, ["sdpa", "sdpa_efficient", "flex"], num_heads=[2, 3], mode=["forward", "forward+backward"])
    assert len(df) == 3 * 2 * 2
    skipped = df[df.status == "skipped"]
    assert skipped.error.str.contains("not divisible by num_heads=3").sum() == 6
    assert skipped.error.str.contains("needs CUDA").any()
    assert skipped.error.str.contains("no backward on cpu").any()
    assert set(df[(df.num_heads == 2) & (df.impl == "sdpa")].status) == {"ok"}


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_cells_do_not_interact_through_compiler_state(tmp_path):
    # FlopCounterMode over eager FlexAttention once broke Dynamo for every later flex cell.
    df = run_tiny(tmp_path, ["flex", "compiled:sdpa"], seq_len=[8, 16, 24], mode=["inference"],
                  settings={"flop_check": True})
    assert set(df.status) == {"ok"}, df[["cell_id", "error"]].to_string()


def test_rounds_pool_samples_in_shuffled_order_and_stop_failing_cells(tmp_path):
    seen = []
    df = attnbench.run(impl=["weight_split", "sdpa", plugin("Raises")], out=tmp_path, settings={**FAST, "rounds": 3},
                       progress=lambda i, n, cell, row: seen.append((i, n, cell.impl, row is None)), **TINY)
    assert len(df) == 3 and df.cell_id.is_unique
    ok = df[df.status == "ok"]
    assert len(ok) == 2
    for r in ok.itertuples():
        assert "3 rounds in shuffled order" in r.notes and r.n == len(r.samples_s) >= 3 * 3
        assert len(r.sample_groups) == 3 and sum(r.sample_groups) == r.n
    assert df[df.impl == plugin("Raises")].status.item() == "error"  # failed in round 1, not run again
    starts = [impl for i, n, impl, starting in seen if starting]
    assert starts.count("weight_split") == 3 and starts.count(plugin("Raises")) == 1
    assert seen[-1][0] == seen[-1][1] == 9  # the progress total is reached


def test_resume_skips_finished_cells_and_rejects_foreign_folders(tmp_path):
    df = run_tiny(tmp_path, ["weight_split"], seq_len=[8, 16])
    run_dir = Path(df.attrs["run_dir"])
    # Pretend the run was killed after the first cell: keep one cell file only.
    cells = sorted((run_dir / "cells").glob("*.parquet"))
    cells[1].unlink()
    (run_dir / "results.parquet").unlink()
    resumed = attnbench.run(resume=run_dir)
    assert sorted(resumed.seq_len) == [8, 16] and len(resumed) == 2
    assert len(list((run_dir / "cells").glob("*.parquet"))) == 2

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text('{"hello": 1}')
    with pytest.raises(ResultsError, match="not an attnbench results file"):
        attnbench.run(resume=foreign)
    corrupt = tmp_path / "corrupt"
    (corrupt / "cells").mkdir(parents=True)
    (corrupt / "meta.json").write_text((run_dir / "meta.json").read_text())
    (corrupt / "cells" / "00000-x.parquet").write_bytes(b"not parquet")
    before = sorted(p.name for p in corrupt.rglob("*"))
    with pytest.raises(ResultsError, match="not a readable results file"):
        attnbench.run(resume=corrupt)
    assert sorted(p.name for p in corrupt.rglob("*")) == before  # nothing overwritten
    with pytest.raises(ResultsError, match="no meta.json"):
        attnbench.run(resume=tmp_path / "missing")


@pytest.mark.slow
def test_isolate_records_a_segfault_and_goes_on(tmp_path):
    df = run_tiny(tmp_path, [plugin("Segfaults"), "sdpa"], settings={"isolate": True}).set_index("impl")
    assert df.loc[plugin("Segfaults"), "status"] == "error"
    assert "SIGSEGV" in df.loc[plugin("Segfaults"), "error"]
    assert df.loc["sdpa", "status"] == "ok"
    assert str(df.loc["sdpa", "worker"]).startswith("subprocess")


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "attnbench", *args], capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.slow  # process starts: the run, its probe's own process, a process per cell
def test_cli_isolate_survives_a_class_that_crashes_the_probe(tmp_path):
    proc = _cli("run", "--impl", f"{plugin('Segfaults')},sdpa", "--isolate", "--seq", "16", "--batch", "1", "--heads",
                "2", "--d-model", "16", "--budget", "0.05", "--out", str(tmp_path), "--no-report")
    assert proc.returncode == 1, proc.stderr  # some cells failed: not a crash of the run
    assert "correctness probe before timing was killed by SIGSEGV in its own process" in proc.stderr
    df, _ = load_run(next(tmp_path.glob("*/results.parquet")))
    rows = df.set_index("impl")
    assert "SIGSEGV" in rows.loc[plugin("Segfaults"), "error"] and rows.loc["sdpa", "status"] == "ok"


@pytest.mark.parametrize("args, fragment", [
    (["run", "--seq", "0"], "--seq 0"),
    (["run", "--seq", "10..5"], "below the start"),
    (["run", "--dtype", "fp8"], "unknown dtype"),
    (["run", "--device", "tpu"], "unknown device"),
    (["run", "--impl", "weight_splt"], "did you mean weight_split"),
    (["run", "--impl", "nofile.py:X"], "does not exist"),
])
def test_cli_bad_input_is_one_line(args, fragment, capsys):
    from attnbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_cli_unknown_flag_in_a_real_process():
    proc = _cli("run", "--bogus")
    assert proc.returncode == 2 and "No such option" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # a real process start or two (15-25 s): the slow set
def test_cli_json_output(tmp_path):
    proc = _cli("run", "--impl", "sdpa", "--seq", "16", "--batch", "1", "--heads", "2", "--d-model", "16",
                "--budget", "0.05", "--out", str(tmp_path), "--json", "--no-report", "--csv")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["cells"] == 1 and summary["status"] == {"ok": 1}
    assert Path(summary["results"]).is_file()
    assert (Path(summary["run_dir"]) / "results.csv").is_file()


@pytest.mark.slow
def test_ctrl_c_keeps_finished_cells_and_exits_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "attnbench", "run", "--impl", plugin("SlowAfterFirstCall"),
                             "--seq", "8..13+1", "--batch", "1", "--heads", "2", "--d-model", "16",
                             "--budget", "0.3", "--out", str(tmp_path), "--no-report"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ATTNBENCH_TEST_SLOW": "1"})
    deadline = time.time() + 120
    cells = []
    while time.time() < deadline:
        cells = list(tmp_path.glob("*/cells/*.parquet"))
        if len(cells) >= 2:
            break
        time.sleep(0.2)
    assert len(cells) >= 2, "the run never finished two cells"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    run_dir = cells[0].parent.parent
    df, meta = load_run(run_dir)
    assert len(df) >= 2 and meta["interrupted"] is True
    assert (run_dir / "results.parquet").is_file()
    resumed = attnbench.run(resume=run_dir, settings={"budget_s": 0.05})  # in-process: the plug-in is fast here
    assert sorted(resumed.seq_len) == list(range(8, 14))


def test_threads_are_set_and_recorded(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        df = run_tiny(tmp_path, ["sdpa"], settings={"threads": 1})
        assert (df.threads == 1).all()
    finally:
        torch.set_num_threads(before)


def test_compiled_cells_report_compile_time_apart(tmp_path):
    df = run_tiny(tmp_path, ["compiled:weight_split"])
    r = df.iloc[0]
    assert r.status == "ok", r.error
    assert r.compile_s > 0 and r.compile_s > 10 * r.median_s
    assert r.recompiles == 0
    assert not math.isnan(r.median_s)


def test_results_table_is_tidy_pandas(tmp_path):
    df = run_tiny(tmp_path, ["weight_split", "sdpa"], seq_len=[8, 16])
    pivot = df.pivot_table(index="seq_len", columns="impl", values="median_s")
    assert pivot.shape == (2, 2) and isinstance(pivot, pd.DataFrame)
    assert os.path.basename(df.attrs["run_dir"]) == df.run_id.iloc[0]


# ---------------------------------------------------------------- hygiene (issue 10)


def test_threads_are_restored_after_an_in_process_run_and_check(tmp_path):
    import torch

    torch.set_num_threads(3)  # the autouse fixture puts back the original afterwards
    df = run_tiny(tmp_path, ["sdpa"], settings={"threads": 1})
    assert (df.threads == 1).all()
    assert torch.get_num_threads() == 3
    attnbench.check(["weight_split"], kinds=["golden"])
    assert torch.get_num_threads() == 3


def test_worker_json_rows_merge_after_normalising():
    """A row read back from JSON may carry None for a missing float (JSON null); normalised, rounds merge."""
    from attnbench.results.schema import Cell, normalise_row
    from attnbench.runner.cell import merge_rounds, run_cell
    from attnbench.runner.sweep import Settings

    cell = Cell("weight_split", batch=1, seq_len=16, num_heads=2, d_model=16)
    rows = [run_cell(cell, Settings(**FAST)) for _ in range(2)]
    wire = [json.loads(json.dumps(r)) for r in rows]  # the worker's protocol: NaN travels as JSON's NaN
    assert math.isnan(wire[0]["recompiles"]) and math.isnan(wire[0]["compile_s"])
    nulls = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in wire]
    with pytest.raises(TypeError):
        merge_rounds(nulls)  # the bug, had such rows not been normalised
    merged = merge_rounds([normalise_row(r) for r in nulls])
    assert math.isnan(merged["recompiles"]) and math.isnan(merged["compile_s"])
    assert merged["n"] == len(merged["samples_s"]) == rows[0]["n"] + rows[1]["n"]
    assert normalise_row({"error": None, "median_s": None})["error"] is None  # strings stay None


@pytest.mark.slow
def test_isolate_with_rounds(tmp_path):
    df = run_tiny(tmp_path, ["weight_split", plugin("Raises")], settings={"isolate": True, "rounds": 2})
    ok = df[df.impl == "weight_split"].iloc[0]
    assert ok.status == "ok" and "2 rounds in shuffled order" in ok.notes, ok.error
    assert ok.n == len(ok.samples_s) and math.isnan(ok.recompiles)
    assert str(ok.worker).startswith("subprocess")
    assert df[df.impl == plugin("Raises")].status.item() == "error"


def test_isolate_measures_the_peak_once_per_device_and_dtype(monkeypatch):
    from attnbench.results.schema import Cell, empty_row
    from attnbench.runner.executors import local
    from attnbench.runner.executors.base import WorkUnit
    from attnbench.runner.sweep import Settings

    asked = []

    class FakeWorker:  # a fresh one per cell under isolate, like the real WorkerProcess
        def __init__(self, env, label):
            self.label, self.pid, self.info = label, 1, {"cpu_allocator": "pinned", "cpu_binding": "b",
                                                         "cpu_affinity": "0", "threads": 1, "names": []}
            self.proc = type("Proc", (), {"poll": staticmethod(lambda: None)})()

        def request(self, message, timeout_s=None):
            cell, peak = Cell(**message["cell"]), message["peak_gflops_per_s"]
            asked.append((cell.impl, cell.dtype, peak))
            row = empty_row(cell, "run")
            row.update(status="ok" if cell.impl != "bad:x" else "error")
            if cell.impl != "bad:x":
                row["peak_gflops_per_s"] = peak or {"float32": 100.0, "float64": 50.0}[cell.dtype]
            return {"row": row}

        def suspend(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(local, "WorkerProcess", FakeWorker)
    executor = local.WorkerExecutor(Settings(isolate=True), "run")
    cells = [Cell("bad:x"), Cell("a:x"), Cell("b:x"), Cell("a:x", dtype="float64"), Cell("b:x", dtype="float64")]
    executor.execute([WorkUnit((c,)) for c in cells], lambda cell, row: None)
    assert asked == [("bad:x", "float32", None), ("a:x", "float32", None), ("b:x", "float32", 100.0),
                     ("a:x", "float64", None), ("b:x", "float64", 50.0)]


@pytest.mark.slow  # issue 45: the README's test command stays under 5 minutes (processes measured)
def test_a_worker_uses_the_peak_it_is_given():
    from attnbench.measure import cpu_env
    from attnbench.results.schema import Cell
    from attnbench.runner.executors.local import WorkerProcess
    from attnbench.runner.sweep import Settings

    worker = WorkerProcess(cpu_env.process_env(cpu_env.CpuEnv()), "test")
    try:
        cell = Cell("weight_split", batch=1, seq_len=16, num_heads=2, d_model=16)
        row = worker.request({"cell": asdict(cell), "settings": asdict(Settings(**FAST)), "run_id": "",
                              "peak_gflops_per_s": 1234.5}, 300)["row"]
    finally:
        worker.close()
    assert row["status"] == "ok", row["error"]
    assert row["peak_gflops_per_s"] == 1234.5 and row["frac_peak"] == pytest.approx(row["gflops_per_s"] / 1234.5)


def test_dynamo_graph_counts_are_optional(monkeypatch):
    from attnbench.runner import cell as cell_module

    assert isinstance(cell_module.compiled_graphs(), int)
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", None)  # this torch has moved them: import fails
    assert cell_module.compiled_graphs() is None
