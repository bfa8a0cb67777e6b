"""CUDA paths of the measurement engine: run where CUDA exists, skipped cleanly where it does not."""

import pytest
import torch

import attnbench
from attnbench.measure import peak_memory, time_fn
from attnbench.results.schema import Cell
from attnbench.runner.workload import build_workload

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


def test_cuda_event_timing_warm_cold_and_graph():
    w = build_workload(Cell("sdpa", device="cuda", dtype="bfloat16", batch=2, seq_len=256, num_heads=4, d_model=256,
                            mode="inference"))
    warm = time_fn(w.step, "cuda", budget_s=0.2)
    cold = time_fn(w.step, "cuda", budget_s=0.2, l2_flush=True)
    graph = time_fn(w.step, "cuda", budget_s=0.2, cuda_graph=True)
    assert warm.timer == cold.timer == "cuda_event" and graph.timer == "cuda_graph"
    for t in (warm, cold, graph):
        assert len(t.samples_s) >= 10 and all(s > 0 for s in t.samples_s)


def test_cuda_peak_memory_is_allocator_based_and_scales_with_T_squared_for_math():
    def peak(impl, T):
        w = build_workload(Cell(impl, device="cuda", dtype="float16", batch=1, seq_len=T, num_heads=4, d_model=256))
        return peak_memory(w.step, "cuda")

    m1, m2 = peak("weight_split", 1024), peak("weight_split", 4096)
    assert m1.method == "cuda_allocator" and m2.peak_reserved_bytes >= 0
    assert m2.peak_bytes / m1.peak_bytes > 8
    f1, f2 = peak("sdpa_flash", 1024), peak("sdpa_flash", 4096)
    assert f2.peak_bytes / f1.peak_bytes < 6


def test_cuda_sweep_rows(tmp_path):
    df = attnbench.run(impl=["weight_split", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex"],
                       device=["cuda"], dtype=["float32", "bfloat16", "float16"], batch=[2], seq_len=[128],
                       num_heads=[4], d_model=[256], mode=["forward", "forward+backward"], cache=["warm", "cold"],
                       out=tmp_path, settings={"budget_s": 0.1})
    assert set(df.status) <= {"ok", "skipped"}, df[df.status != "ok"][["cell_id", "error"]].to_string()
    ok = df[df.status == "ok"]
    assert {"weight_split", "sdpa"} <= set(ok.impl)
    assert (ok.timer == "cuda_event").all()
    assert ok.peak_reserved_bytes.notna().all()
    assert df.device_name.dropna().str.len().gt(0).all()


def test_cuda_oom_is_recorded_and_released(tmp_path):
    free, _ = torch.cuda.mem_get_info()
    T = 65536  # weight_split at this length needs b*h*T^2*4 bytes of scores: far beyond any GPU
    df = attnbench.run(impl=["weight_split", "sdpa"], device=["cuda"], dtype=["float32"], batch=[4], seq_len=[T],
                       num_heads=[16], d_model=[256], mode=["forward"], out=tmp_path, settings={"budget_s": 0.1})
    ws = df[df.impl == "weight_split"].iloc[0]
    assert ws.status == "oom"
    assert torch.cuda.mem_get_info()[0] >= 0.9 * free  # the failed cell's memory was released
