"""The resolver: every rule without a GPU (CUDA and PyTorch's SDPA capability checks monkeypatched)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from attnbench import registry
from attnbench import resolve as rs
from attnbench.errors import InvalidSpecError, SweepError, UnavailableError
from attnbench.registry import resolve  # names looked up (attnbench.resolve.resolve takes an Implementation)
from attnbench.resolve import Ready, Request, Skip
from attnbench.results.schema import Cell
from attnbench.spec import AttnSpec


@pytest.fixture
def fake_cuda(monkeypatch):
    """This machine has one CUDA device as far as the resolver knows; records the SDPA capability questions."""
    asked = []

    def parse(device):
        kind = rs.parse_device_type(device)
        return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")

    monkeypatch.setattr(rs, "cuda_available", lambda: True)
    monkeypatch.setattr(rs, "parse_device", parse)

    def capability(backend, device, dtype, batch, num_heads, seq_len, head_dim, requires_grad=False, dropout_p=0.0):
        asked.append(dict(backend=backend, device=device, dtype=dtype, batch=batch, num_heads=num_heads,
                          seq_len=seq_len, head_dim=head_dim, requires_grad=requires_grad, dropout_p=dropout_p))
        if backend == "flash" and (dtype not in ("float16", "bfloat16") or head_dim % 8):
            return "PyTorch's flash SDPA kernel cannot run this cell: (as PyTorch says)"
        return None

    monkeypatch.setattr(rs, "sdpa_capability", capability)
    # the implementations' own probes run a kernel on the device: not here
    monkeypatch.setattr(rs, "RULES", [r for r in rs.RULES if r is not rs.probe_rule])
    return asked


def test_ready_carries_the_parsed_device_and_dtype():
    out = resolve("weight_split", Cell("weight_split", device="CPU ", dtype="fp32"))
    assert out == Ready(torch.device("cpu"), torch.float32) and out.reason is None


def test_sdpa_flash_fp32_on_cuda_is_skipped_with_pytorchs_reason(fake_cuda):
    out = resolve("sdpa_flash", Cell("sdpa_flash", device="cuda", dtype="float32", batch=2, seq_len=64,
                                      num_heads=4, d_model=256, mode="forward+backward"))
    assert isinstance(out, Skip) and "PyTorch's flash SDPA kernel" in out.reason
    assert fake_cuda[-1] == dict(backend="flash", device=torch.device("cuda", 0), dtype="float32", batch=2,
                                 num_heads=4, seq_len=64, head_dim=64, requires_grad=True, dropout_p=0.0)
    assert "sdpa_flash cannot run on cuda (float32)" in str(out.exception())


@pytest.mark.parametrize(("dtype", "d_model", "ready"), [("float16", 256, True), ("bfloat16", 8, False),
                                                         ("float64", 256, False)])
def test_sdpa_flash_on_cuda_follows_dtype_and_head_dim(fake_cuda, dtype, d_model, ready):
    out = resolve("sdpa_flash", Cell("sdpa_flash", device="cuda:0", dtype=dtype, num_heads=4, d_model=d_model))
    assert isinstance(out, Ready) is ready
    if ready:
        assert out.device == torch.device("cuda", 0) and out.dtype == getattr(torch, dtype)


def test_sdpa_rule_asks_only_forced_backends_on_cuda(fake_cuda):
    assert isinstance(resolve("sdpa", Cell("sdpa", device="cuda", dtype="float32")), Ready)  # the dispatcher picks
    assert isinstance(resolve("sdpa_flash", Cell("sdpa_flash", device="cpu", dtype="float32")), Ready)
    assert fake_cuda == []
    resolve("compiled:sdpa_efficient", Cell("compiled:sdpa_efficient", device="cuda", mode="inference"))
    assert fake_cuda[-1]["backend"] == "efficient" and fake_cuda[-1]["requires_grad"] is False


def test_dropout_in_train_mode_reaches_the_sdpa_check(fake_cuda):
    spec = AttnSpec(32, 32, 16, 0.5, 4)
    resolve("sdpa_flash", spec, device="cuda", dtype="float16", mode="forward", batch=3, seq_len=11)
    assert fake_cuda[-1]["dropout_p"] == 0.5 and fake_cuda[-1]["batch"] == 3 and fake_cuda[-1]["seq_len"] == 11
    resolve("sdpa_flash", spec, device="cuda", dtype="float16", mode="inference")
    assert fake_cuda[-1]["dropout_p"] == 0.0


def test_rules_in_order(isolated_registry):
    registry.register("cpu_only_no_grad", registry.get("weight_split").factory, description="x", devices=("cpu",),
                      backward=False, dropout=False, dtypes=("float32",))
    impl = registry.get("cpu_only_no_grad")
    cases = [
        (Cell(impl.name, d_model=100, num_heads=3), "d_model=100 is not divisible by num_heads=3"),
        (Cell(impl.name, dtype="float16"), "does not support float16 (supports float32)"),
        (Cell(impl.name, mode="forward"), "declares no backward on cpu (needed for forward)"),
        (Cell(impl.name, cache="cold", mode="inference"), "cold cache (L2 flush) exists only for CUDA cells"),
    ]
    for cell, reason in cases:
        assert resolve(impl, cell).reason == reason
    assert resolve(impl, Cell(impl.name, mode="inference")).reason is None
    assert resolve(impl, AttnSpec(8, 8, 4, 0.5, 2), mode="inference").reason is None  # eval: dropout not applied
    with_grad = dataclasses.replace(impl, backward=("cpu",))
    assert resolve(with_grad, AttnSpec(8, 8, 4, 0.5, 2), mode="forward").reason == "declares no dropout on cpu"


def test_device_rules():
    assert resolve("sdpa_efficient", device="cpu").reason == "needs CUDA"
    if not torch.cuda.is_available():
        reason = resolve("weight_split", device="cuda:1").reason
        assert "CUDA is not available" in reason


def test_width_rule_and_error_class():
    out = resolve("torch_mha", AttnSpec(3, 4, 5, 0.0, 2), device="cpu", dtype="float32")
    assert out.reason == "needs d_in == d_out, got d_in=3, d_out=4" and isinstance(out.exception(), UnavailableError)
    bad = resolve("sdpa", Cell("sdpa", d_model=100, num_heads=3))
    assert isinstance(bad.exception(), InvalidSpecError)


def test_torch_version_rule_uses_release_numbers(isolated_registry, monkeypatch):
    impl = dataclasses.replace(registry.get("weight_split"), min_torch="2.6")
    monkeypatch.setattr(torch, "__version__", "2.6.0a0+git1234")  # a nightly of 2.6 is 2.6
    assert resolve(impl).reason is None
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    assert resolve(impl).reason == "needs torch >= 2.6 (installed 2.5.1+cu121)"
    assert registry.get("compiled:flex").min_torch == "2.5"  # max(base, "2.1") by version, not by string


@pytest.mark.parametrize(("kw", "message"), [({"device": "tpu"}, "unknown device"), ({"dtype": "fp8"}, "unknown dtype"),
                                             ({"mode": "backward"}, "unknown mode")])
def test_bad_requests_are_user_errors_not_skips(kw, message):
    with pytest.raises(SweepError, match=message):
        resolve("weight_split", **kw)


def test_a_new_rule_is_one_function(monkeypatch):
    def window_rule(impl, req):
        return "no sliding window" if req.seq_len and req.seq_len > 100 else None

    monkeypatch.setattr(rs, "RULES", [*rs.RULES, window_rule])
    assert resolve("sdpa", Cell("sdpa", seq_len=128)).reason == "no sliding window"
    assert resolve("sdpa", Cell("sdpa", seq_len=64)).reason is None


def test_request_from_cell_spec_and_keywords():
    req = rs.request_for(Cell("x", device="cuda:1", dtype="bf16", batch=3, seq_len=9, num_heads=2, d_model=8,
                              mode="forward", cache="cold"))
    assert req == Request("cuda:1", "bfloat16", "forward", 8, 8, 2, 3, 9, 0.0, "cold", lengths="")  # a rectangle
    assert req.head_dim == 4 and req.train
    spec_req = rs.request_for(AttnSpec(6, 4, 5, 0.25, 2), device="cpu", mode="inference")
    assert (spec_req.d_in, spec_req.d_out, spec_req.dropout, spec_req.train) == (6, 4, 0.25, False)


# ---------------------------------------------------------------- the wrapper around PyTorch's API


def test_sdpa_capability_collects_pytorchs_reasons(monkeypatch):
    seen = {}

    def can_use(params, debug=False):
        seen["q"], seen["debug"] = params.query, debug
        warnings.warn("Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float",
                      UserWarning, stacklevel=1)
        return False

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", can_use)
    rs.sdpa_capability.cache_clear()
    reason = rs.sdpa_capability("flash", torch.device("cpu"), "float32", 2, 4, 33, 64, requires_grad=True)
    rs.sdpa_capability.cache_clear()
    assert reason.startswith("PyTorch's flash SDPA kernel cannot run this cell: Expected query, key and value")
    q = seen["q"]
    assert seen["debug"] and q.shape == (2, 4, 33, 64) and q.stride(-1) == 1 and q.requires_grad
    assert q.dtype == torch.float32


def test_sdpa_capability_without_the_api_says_nothing(monkeypatch):
    monkeypatch.delattr(torch.backends.cuda, "can_use_efficient_attention")
    rs.sdpa_capability.cache_clear()
    try:
        assert rs.sdpa_capability("efficient", torch.device("cpu"), "float32", 1, 2, 8, 4) is None
    finally:
        rs.sdpa_capability.cache_clear()


def test_sdpa_capability_real_call_gives_a_reason_off_cuda():
    """The installed torch's own check, on CPU tensors: never usable, and the answer is a reason, not a crash."""
    rs.sdpa_capability.cache_clear()
    reason = rs.sdpa_capability("flash", torch.device("cpu"), "float16", 1, 2, 8, 8)
    rs.sdpa_capability.cache_clear()
    assert reason is not None and reason.startswith("PyTorch's flash SDPA kernel cannot run this cell")


def test_native_warning_lines_are_read():
    m = rs._NATIVE_WARNING.match("[W1130 17:00:00.123 sdp_utils.cpp:123] Warning: Flash attention requires "
                                 "head_dim % 8 == 0 (function check_head_dim_size_flash)")
    assert m and m.group(1) == "Flash attention requires head_dim % 8 == 0"


@pytest.mark.cuda
def test_sdpa_flash_in_float32_is_a_skip_on_cuda(cuda_device):
    out = resolve("sdpa_flash", Cell("sdpa_flash", device=cuda_device, dtype="float32"))
    assert isinstance(out, Skip) and "flash" in out.reason
    hd1 = resolve("sdpa_flash", AttnSpec(3, 2, 6, 0.0, 2), device=cuda_device, dtype="float16", mode="inference")
    assert isinstance(hd1, Skip)


def test_the_resolve_module_takes_implementations_and_says_where_names_go():
    # issue 40: resolve never imports the registry (no import cycle, not even by name); the registry's resolve does
    with pytest.raises(TypeError, match=r"attnbench.registry.resolve\('sdpa', ...\)"):
        rs.resolve("sdpa", Cell("sdpa"))
    assert rs.resolve(registry.get("sdpa"), Cell("sdpa")).reason == resolve("sdpa", Cell("sdpa")).reason
