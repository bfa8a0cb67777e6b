"""Channels-first attention layers: projections that are pointwise ``nn.Conv1d`` on ``(B, C, T)`` (issue 46).

VITS's and Glow-TTS's ``MultiHeadAttention`` project with ``nn.Conv1d(channels, channels, 1)`` and take their inputs
``(B, C, T)``, channels before time. That is the same function as ``nn.Linear`` on ``(B, T, C)``: a kernel-1
convolution's weight ``(out, in, 1)`` is a linear map's ``(out, in)``. A class whose every projection is such a
convolution (and that has no ``nn.Linear`` of its own) is checked as it is: each pointwise ``Conv1d`` is replaced by
:class:`PointwiseConv`, an ``nn.Linear`` under the same name (so the weights map as any linear layer's) whose forward
still takes ``(B, C, T)``, and the class's sequence inputs are handed to its forward transposed, its output transposed
back (by a subclass made for the instance, whose forward calls the class's: its code is unchanged). ``check -v`` says
so.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn import functional as F

NOTE = ("channels first: its projections are pointwise nn.Conv1d ({names}) on (B, C, T) inputs; checked as linear "
        "layers of the same weights, its inputs given (B, C, T) and its output read back as (B, T, C)")


class PointwiseConv(nn.Linear):
    """A kernel-1 ``nn.Conv1d`` as an ``nn.Linear``: weight ``(out, in)``, forward on ``(B, in, T)`` -> ``(B, out, T)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.transpose(1, -1), self.weight, self.bias).transpose(1, -1)


def _pointwise(m: nn.Module) -> bool:
    return (isinstance(m, nn.Conv1d) and m.kernel_size == (1,) and m.stride == (1,) and m.groups == 1
            and m.dilation == (1,) and m.padding in ((0,), "valid"))


def pointwise_convs(module: nn.Module) -> list[str]:
    """The names of ``module``'s pointwise ``Conv1d`` layers when they are all its projections (at least three, and no
    ``nn.Linear``), else ``[]``."""
    if any(isinstance(m, nn.Linear) for m in module.modules()):
        return []
    names = [n for n, m in module.named_modules() if _pointwise(m)]
    return names if len(names) >= 3 else []


def as_channels_last(module: nn.Module, width: int) -> nn.Module:
    """``module`` (its pointwise convolutions replaced by :class:`PointwiseConv`) taking ``(B, T, C)`` inputs: every
    3-D tensor argument whose last axis is ``width`` is passed as ``(B, C, T)``, a 3-D output is returned ``(B, T, C)``."""
    for name in pointwise_convs(module):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        conv = getattr(parent, child)
        linear = PointwiseConv(conv.in_channels, conv.out_channels, bias=conv.bias is not None,
                               device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(conv.weight[..., 0])
            if conv.bias is not None:
                linear.bias.copy_(conv.bias)
        setattr(parent, child, linear)

    return transposed_io(module, width, (1, 2), "attnbench_channels_first")


def transposed_io(module: nn.Module, width: int, dims: tuple[int, int], marker: str) -> nn.Module:
    """``module`` whose forward gets every 3-D tensor argument whose last axis is ``width`` transposed on ``dims``, and
    whose 3-D output (or a tuple's first element) is transposed back: a subclass made for the instance, whose forward
    calls the class's (its code unchanged; ``marker`` set on it). Channels first ``(1, 2)``, time first
    (:mod:`~attnbench.plugins.time_first`) ``(0, 1)``."""
    def flip(t):
        return t.transpose(*dims) if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == width else t

    cls = type(module)

    def forward(self, *args, **kwargs):
        out = cls.forward(self, *(flip(a) for a in args), **{k: flip(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor) and out.dim() == 3:
            return out.transpose(*dims)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 3:
            return (out[0].transpose(*dims), *out[1:])
        return out

    forward.__signature__ = inspect.signature(cls.forward)
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__, marker: True})
    return module
