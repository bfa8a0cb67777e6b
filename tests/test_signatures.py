"""attnbench.plugins.signatures: constructors and forwards hidden behind ``(*args, **kwargs)`` wrappers."""

from __future__ import annotations

import inspect

from torch import nn

from attnbench.plugins.binding import bind
from attnbench.plugins.signatures import signature


def kernelized(cls):
    """Wraps ``cls.__init__`` as transformers 5.25's ``use_kernelized_func`` does: no ``functools.wraps``."""
    orig_init = cls.__init__

    def new_init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self.extra = True

    cls.__init__ = new_init
    return cls


@kernelized
class Hidden(nn.Module):
    def __init__(self, d_model: int, n_heads: int, layer_idx: int):
        super().__init__()
        self.d_model, self.n_heads, self.layer_idx = d_model, n_heads, layer_idx


def test_a_hidden_constructor_is_read_through_its_wrapper():
    assert inspect.signature(Hidden).parameters.keys() == {"args", "kwargs"}  # what inspect alone sees
    assert list(signature(Hidden).parameters) == ["d_model", "n_heads", "layer_idx"]
    assert list(signature(Hidden.__init__).parameters) == ["self", "d_model", "n_heads", "layer_idx"]


def test_binding_fills_a_hidden_layer_index():
    binding = bind(Hidden)
    assert dict(binding.extras) == {"layer_idx": 0}
    assert {p for p, _ in binding.params} == {"d_model", "n_heads"}


def test_a_forward_wrapped_without_wraps():
    def plain(fn):
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    class M(nn.Module):
        @plain
        def forward(self, x, mask=None):
            return x

    assert list(signature(M.forward).parameters) == ["self", "x", "mask"]
    assert list(signature(M().forward).parameters) == ["x", "mask"]


def test_a_genuine_varargs_function_is_left_alone():
    def anything(*args, **kwargs):
        return args

    assert list(signature(anything).parameters) == ["args", "kwargs"]
