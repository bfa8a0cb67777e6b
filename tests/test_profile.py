"""``attnbench profile``: traces, the operator table, the CLI, and a real TensorBoard reading the traces."""

from __future__ import annotations

import dataclasses
import gzip
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from attnbench.cli import main
from attnbench.devices import cuda_available
from attnbench.errors import InvalidSpecError, ResultsError, UnknownImplementationError
from attnbench.profiling import OPS_COLUMNS, ProfileResult, default_run_name, load_ops, profile_cell, save_ops
from attnbench.results.schema import Cell

SMALL = {"batch": 1, "seq_len": 16, "num_heads": 2, "d_model": 32}
SDPA_OPS = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"}


def small(impl: str, **kw) -> Cell:
    return Cell(impl=impl, **{**SMALL, **kw})


@pytest.fixture(scope="module")
def sdpa_result(tmp_path_factory) -> ProfileResult:
    return profile_cell(small("sdpa"), logdir=tmp_path_factory.mktemp("logdir"))


# --- run names ---------------------------------------------------------------------------------------------


def test_default_run_name_is_readable_and_safe():
    cell = Cell(impl="weight_split", batch=2, seq_len=128, num_heads=4, d_model=256, mode="forward")
    assert default_run_name(cell) == "weight_split-cpu-float32-b2-T128-h4-d256-forward"
    odd = default_run_name(Cell(impl="compiled:sdpa@max-autotune", device="cuda:1", mode="forward+backward"))
    assert odd == "compiled_sdpa_max-autotune-cuda_1-float32-b1-T128-h4-d256-forward_backward"
    plugin = default_run_name(Cell(impl="../plugins/my attn.py:MyAttn"))
    assert "/" not in plugin and " " not in plugin and not plugin.startswith(".")
    assert len(default_run_name(Cell(impl="x" * 500))) < 200


# --- profile_cell --------------------------------------------------------------------------------------------


def test_trace_is_chrome_trace_json_in_its_own_run_folder(sdpa_result):
    res = sdpa_result
    assert res.run_dir == res.logdir / "sdpa-cpu-float32-b1-T16-h2-d32-forward"
    assert res.run_name == "sdpa-cpu-float32-b1-T16-h2-d32-forward"
    assert len(res.trace_files) == 1
    trace = res.trace_file
    assert trace.parent == res.run_dir and trace.name.endswith(".pt.trace.json")
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    cpu_ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert cpu_ops & SDPA_OPS
    assert "aten::softmax" not in cpu_ops  # the fused kernel, not the book's softmax
    assert data["attnbench"]["cell_id"] == small("sdpa").cell_id
    assert data["record_shapes"] == 1 and data["profile_memory"] == 1 and data["with_stack"] == 1
    assert sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#")) == 3  # the active window


def test_ops_table_columns_values_and_order(sdpa_result):
    ops = sdpa_result.ops
    assert list(ops.columns) == list(OPS_COLUMNS)
    assert len(ops) > 5
    assert set(ops["impl"]) == {"sdpa"} and set(ops["cell_id"]) == {small("sdpa").cell_id}
    assert set(ops["op"]) & SDPA_OPS
    assert not ops["op"].str.startswith("ProfilerStep").any()
    assert not ops["op"].str.contains(r"\.py\(\d+\)|^<built-in", regex=True).any()  # no Python stack frames
    assert (ops["self_cpu_s"] > 0).any() and ops["self_cpu_s"].iloc[0] > 0
    assert (ops["cpu_total_s"] >= ops["self_cpu_s"] - 1e-9).all()
    assert ops["self_cpu_s"].is_monotonic_decreasing
    assert (ops["self_device_s"] == 0.0).all() and (ops["device_total_s"] == 0.0).all()
    assert (ops["calls"] > 0).all()
    assert ops["cpu_memory_bytes"].max() > 0  # profile_memory recorded allocations
    linear = ops.set_index("op").loc["aten::linear"]
    assert linear["calls"] == 4 * 3  # q, k, v, out projections in each of the 3 active steps


def test_ops_table_on_cuda_keeps_host_operators_by_device_time():
    """Kernels are rows of key_averages() too; they must not double-count the time of the ops that launched them."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from attnbench.profiling import ops_table

    def avg(key, device=DeviceType.CPU, self_cpu=10.0, cpu=20.0, self_dev=0.0, dev=0.0):
        return NS(key=key, device_type=device, count=3, self_cpu_time_total=self_cpu, cpu_time_total=cpu,
                  self_device_time_total=self_dev, device_time_total=dev, self_cpu_memory_usage=0,
                  cpu_memory_usage=0)

    averages = [avg("aten::mm", self_dev=50.0, dev=50.0), avg("aten::softmax", self_cpu=99.0, dev=30.0),
                avg("aten::_softmax", self_dev=30.0, dev=30.0), avg("cudaLaunchKernel", self_cpu=40.0),
                avg("sm90_gemm_kernel", DeviceType.CUDA, 0.0, 0.0, 50.0, 50.0), avg("ProfilerStep*", self_cpu=500.0),
                avg("[memory]"), avg("nn.Module: Linear_0")]
    prof = NS(key_averages=lambda: averages,
              events=lambda: [NS(key="nn.Module: Linear_0", is_python_function=True),
                              NS(key="aten::mm", is_python_function=False)])
    ops = ops_table(prof, Cell(impl="sdpa", device="cuda"))
    assert list(ops["op"]) == ["aten::mm", "aten::_softmax", "aten::softmax", "cudaLaunchKernel"]
    assert ops["self_device_s"].sum() == pytest.approx(80e-6)  # = the kernels' time, counted once
    assert ops.set_index("op").loc["aten::softmax", "device_total_s"] == pytest.approx(30e-6)
    assert list(ops.columns) == list(OPS_COLUMNS)


@pytest.mark.cuda
def test_cuda_profile_records_kernels(tmp_path, cuda_device):
    res = profile_cell(small("sdpa", device=cuda_device, dtype="float16"), logdir=tmp_path)
    assert res.ops["self_device_s"].iloc[0] > 0 and res.ops["self_device_s"].is_monotonic_decreasing
    events = json.loads(res.trace_file.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)


def test_result_is_frozen_and_hashable(sdpa_result):
    with pytest.raises(dataclasses.FrozenInstanceError):
        sdpa_result.run_dir = Path("/elsewhere")  # type: ignore[misc]
    assert hash(sdpa_result) == hash(sdpa_result)


def test_backward_mode_records_autograd_and_run_name_stays_inside_logdir(tmp_path):
    res = profile_cell(small("weight_split", mode="forward+backward"), logdir=tmp_path, wait=0, warmup=1,
                       active=1, run_name="../../escape/fb")
    assert res.run_dir.is_relative_to(tmp_path) and res.run_dir.is_dir()
    ops = set(res.ops["op"])
    assert any("Backward" in op for op in ops), sorted(ops)
    assert {"aten::bmm", "aten::_softmax"} <= ops


def test_impossible_cells_fail_before_writing(tmp_path):
    logdir = tmp_path / "logs"
    with pytest.raises(InvalidSpecError, match="divisible"):
        profile_cell(Cell(impl="sdpa", d_model=100, num_heads=3), logdir=logdir)
    with pytest.raises(UnknownImplementationError):
        profile_cell(Cell(impl="no_such_impl"), logdir=logdir)
    with pytest.raises(ValueError, match="active"):
        profile_cell(small("sdpa"), logdir=logdir, active=0)
    assert not logdir.exists()


# --- ops.parquet ---------------------------------------------------------------------------------------------


def test_save_load_round_trip(sdpa_result, tmp_path):
    second = dataclasses.replace(sdpa_result, ops=sdpa_result.ops.assign(impl="other"))
    path = save_ops([sdpa_result, second], tmp_path / "run" / "profile" / "ops.parquet")
    assert path == tmp_path / "run" / "profile" / "ops.parquet" and path.is_file()
    back = load_ops(path)
    assert list(back.columns) == list(OPS_COLUMNS)
    assert len(back) == 2 * len(sdpa_result.ops)
    assert set(back["impl"]) == {"sdpa", "other"}
    pd.testing.assert_frame_equal(back[back.impl == "sdpa"].reset_index(drop=True), sdpa_result.ops)
    assert str(back["calls"].dtype) == "int64" and str(back["self_cpu_s"].dtype) == "float64"
    pd.testing.assert_frame_equal(load_ops(path.parent), back)  # the folder works too
    save_ops(sdpa_result.ops, path)  # a DataFrame, replacing the file
    assert len(load_ops(path)) == len(sdpa_result.ops)


def test_save_and_load_reject_foreign_tables(tmp_path):
    with pytest.raises(ValueError, match="lacks columns"):
        save_ops(pd.DataFrame({"op": ["x"]}), tmp_path / "ops.parquet")
    with pytest.raises(ResultsError, match="does not exist"):
        load_ops(tmp_path / "missing.parquet")
    pd.DataFrame({"op": ["x"]}).to_parquet(tmp_path / "foreign.parquet")
    with pytest.raises(ResultsError, match="missing columns"):
        load_ops(tmp_path / "foreign.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ResultsError, match="not a readable"):
        load_ops(tmp_path / "junk.parquet")


# --- CLI -----------------------------------------------------------------------------------------------------


def test_cli_prints_top_ops_and_the_tensorboard_command(tmp_path, capsys):
    logdir = tmp_path / "tb logs"  # a space: the printed command must quote it
    main(["profile", "--impl", "weight_split", "--batch", "1", "--seq", "16", "--heads", "2", "--d-model", "32",
          "--logdir", str(logdir), "--top", "5"])
    out = capsys.readouterr().out
    assert "weight_split: top 5 of" in out
    for col in ("operator", "calls", "self CPU", "CPU total", "self CPU mem"):
        assert col in out
    assert "aten::" in out
    assert f"tensorboard --logdir '{logdir.resolve()}' --host 127.0.0.1 --port 6006" in out
    assert "https://ui.perfetto.dev" in out and "chrome://tracing" in out
    run = logdir / "weight_split-cpu-float32-b1-T16-h2-d32-forward"
    traces = list(run.glob("*.pt.trace.json"))
    assert len(traces) == 1 and f"trace: {traces[0]}" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--impl", "no_such_impl"], "unknown implementation 'no_such_impl'"),
    (["--impl", "sdpa", "--d-model", "100", "--heads", "3"], "not divisible by num_heads=3"),
    (["--impl", "sdpa", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--impl", "sdpa,no_such_impl"], "unknown implementation 'no_such_impl'"),  # fails before sdpa runs
    pytest.param(["--impl", "sdpa", "--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(cuda_available(), reason="CUDA is available here")),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, message):
    logdir = tmp_path / "logs"
    with pytest.raises(SystemExit) as exc:
        main(["profile", *args, "--logdir", str(logdir)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not logdir.exists()


# --- end to end: a real TensorBoard with the torch-tb-profiler plugin reads the traces --------------------------

PLUGIN = "/data/plugin/pytorch_profiler/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tensorboard(tmp_path):
    """Start ``tensorboard --logdir LOGDIR`` on a free local port; always stopped at teardown."""
    pytest.importorskip("tensorboard", reason="needs the profile extra: pip install 'attnbench[profile]'")
    pytest.importorskip("torch_tb_profiler", reason="needs the profile extra: pip install 'attnbench[profile]'")
    started: list[tuple[subprocess.Popen, object]] = []

    def start(logdir: Path) -> tuple[str, subprocess.Popen, Path]:
        port = _free_port()
        log_path = tmp_path / f"tensorboard-{port}.log"
        log = open(log_path, "wb")  # closed at teardown
        proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                 "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append((proc, log))
        return f"http://127.0.0.1:{port}", proc, log_path

    yield start
    for proc, log in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        log.close()


def _get(base: str, route: str, **params):
    url = base + PLUGIN + route + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read()
        if resp.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
    return json.loads(body)


@pytest.mark.slow
def test_tensorboard_profiler_plugin_reads_both_runs(tmp_path, tensorboard):
    logdir = tmp_path / "runs"
    results = {impl: profile_cell(small(impl), logdir=logdir) for impl in ("sdpa", "weight_split")}
    base, proc, log_path = tensorboard(logdir)

    deadline = time.monotonic() + 60
    runs: dict = {}
    while True:
        if proc.poll() is not None:
            pytest.fail(f"tensorboard exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            runs = _get(base, "runs")
            if not runs["loading"] and {r.run_name for r in results.values()} <= set(runs["runs"]):
                break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            pytest.fail(f"runs not loaded within 60 s (last answer {runs}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)

    expected = {
        "sdpa": ([SDPA_OPS], {"aten::softmax", "aten::_softmax", "aten::bmm"}),
        "weight_split": ([{"aten::matmul", "aten::bmm"}, {"aten::softmax", "aten::_softmax"}], SDPA_OPS),
    }
    for impl, res in results.items():
        run = res.run_name
        views = _get(base, "views", run=run)
        assert {"Overview", "Operator", "Trace", "Memory"} <= set(views), views
        workers = _get(base, "workers", run=run, view="Overview")
        assert len(workers) == 1, workers
        spans = _get(base, "spans", run=run, worker=workers[0])
        assert spans, spans
        which = {"run": run, "worker": workers[0], "span": spans[0]}

        overview = _get(base, "overview", **which)
        assert len(overview["steps"]["rows"]) == res.active_steps  # one row per recorded step
        assert overview["performance"][0]["name"] == "Average Step Time"
        assert {"title": "Device Type", "value": "CPU"} in overview["environments"]

        table = _get(base, "operation/table", group_by="Operation", **which)
        names = {row["name"]: row for row in table["data"]}
        for alternatives in expected[impl][0]:
            assert names.keys() & alternatives, f"{impl}: none of {alternatives} in {sorted(names)}"
        assert not names.keys() & expected[impl][1], f"{impl}: unexpected {names.keys() & expected[impl][1]}"
        ours = res.ops.set_index("op")["calls"]
        for op in names.keys() & (set().union(*expected[impl][0])):
            assert names[op]["calls"] == ours[op], op  # TensorBoard and our table agree on call counts

        pie = _get(base, "operation", group_by="Operation", **which)
        assert pie["host_self_time"]["rows"], pie

        trace = _get(base, "trace", **which)  # what the Trace view (and Perfetto) shows
        assert trace["traceEvents"]


def test_profiler_lines_never_reach_stderr(tmp_path, capfd):
    """kineto's "USDT: ... profiler_start/stop" lines go to file descriptor 2; `run --profile -q` stays quiet."""
    profile_cell(small("weight_split"), logdir=tmp_path / "logs")
    assert "USDT" not in capfd.readouterr().err
    main(["run", "--impl", "weight_split", "--seq", "16", "--heads", "2", "--d-model", "32", "--batch", "1",
          "--budget", "0.05", "--out", str(tmp_path / "results"), "--profile", "--no-report", "-q"])
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""
