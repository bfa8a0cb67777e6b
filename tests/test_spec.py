"""AttnSpec validation and input-shape errors, from the spec and from every built module's forward."""

from __future__ import annotations

import re

import pytest
import torch

from attnbench import registry
from attnbench.correctness.cases import computes_mla
from attnbench.errors import AttnbenchError, InputShapeError, InvalidSpecError, UnavailableError
from attnbench.spec import AttnSpec

pytestmark = pytest.mark.usefixtures("single_thread")


def test_valid_spec_matches_the_book_constructor():
    spec = AttnSpec(3, 2, 6, 0.0, 2)
    assert spec.head_dim == 1 and spec.qkv_bias is False
    assert list(spec.kwargs()) == ["d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias"]
    assert AttnSpec(**spec.kwargs()) == spec
    assert AttnSpec(12, 16, 10, 0.1, 4, True).head_dim == 4


@pytest.mark.parametrize("d_out, num_heads", [(10, 3), (768, 5), (2, 4)])
def test_heads_must_divide_d_out_and_the_message_suggests_heads(d_out, num_heads):
    with pytest.raises(InvalidSpecError, match=f"d_out={d_out} is not divisible by num_heads={num_heads}") as info:
        AttnSpec(8, d_out, 16, 0.0, num_heads)
    assert isinstance(info.value, ValueError)
    suggested = re.search(r"choose num_heads from \[([\d, ]+)\]", str(info.value))
    assert suggested, str(info.value)
    heads = [int(h) for h in suggested.group(1).split(",")]
    assert heads and all(d_out % h == 0 for h in heads)
    assert min(abs(h - num_heads) for h in heads) == min(abs(h - num_heads) for h in range(1, d_out + 1)
                                                            if d_out % h == 0)


@pytest.mark.parametrize("field", ["d_in", "d_out", "context_length", "num_heads"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes(field, value):
    kwargs = {"d_in": 4, "d_out": 4, "context_length": 4, "dropout": 0.0, "num_heads": 2, field: value}
    with pytest.raises(InvalidSpecError, match=f"{field} must be positive, got {value}"):
        AttnSpec(**kwargs)


@pytest.mark.parametrize("value", [2.0, "4", True, None])
def test_non_int_sizes(value):
    with pytest.raises(InvalidSpecError, match="d_in must be an int"):
        AttnSpec(value, 4, 4, 0.0, 2)


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5])
def test_dropout_range(dropout):
    with pytest.raises(InvalidSpecError, match=r"dropout must be in \[0, 1\)"):
        AttnSpec(4, 4, 4, dropout, 2)


SPEC = AttnSpec(6, 8, 5, 0.0, 2)
BAD_INPUTS = {
    "too_long": ((2, 6, 6), r"sequence length 6 is outside 1..context_length=5"),
    "empty": ((2, 0, 6), r"sequence length 0 is outside"),
    "rank2": ((5, 6), r"got rank 2.*unsqueeze\(0\)"),
    "rank4": ((1, 2, 5, 6), r"got rank 4"),
    "width": ((2, 5, 7), r"input width is 7 but the layer was built with d_in=6"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_spec_check_input(case):
    shape, message = BAD_INPUTS[case]
    with pytest.raises(InputShapeError, match=message):
        SPEC.check_input(torch.zeros(shape))
    SPEC.check_input(torch.zeros(2, 5, 6))
    SPEC.check_input(torch.zeros(1, 1, 6))


@pytest.mark.parametrize("name", registry.available("cpu"))
def test_builtin_forward_rejects_bad_inputs(name):
    impl = registry.get(name)
    spec = AttnSpec(8, 8, 5, 0.0, 2) if impl.same_width_only else SPEC
    if computes_mla(impl):  # issue 46: a DeepSeek-style MLA built-in computes nothing else
        spec = AttnSpec(6, 8, 5, 0.0, 2, rope_theta=100.0, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
                        v_head_dim=4)
    module = impl.build(spec)
    with torch.no_grad():
        try:
            assert module(torch.randn(2, 5, spec.d_in)).shape == (2, 5, spec.d_out)
        except UnavailableError as exc:  # varlen_nested: no CPU kernel for causal nested SDPA; its inputs still checked
            assert "PyTorch's nested-tensor SDPA" in str(exc)
        for shape, message in [((2, 6, spec.d_in), "context_length=5"), ((5, spec.d_in), "rank 2"),
                               ((2, 5, spec.d_in + 1), f"d_in={spec.d_in}")]:
            with pytest.raises(InputShapeError, match=message) as info:
                module(torch.randn(shape))
            assert isinstance(info.value, AttnbenchError)
