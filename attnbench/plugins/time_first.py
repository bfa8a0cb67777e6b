"""Time-first attention layers: a forward that takes ``(T, B, C)`` (fairseq's ``MultiheadAttention``) (issue 46).

fairseq's ``MultiheadAttention`` and the many classes that copy it (ESM, BART and wav2vec ports, Uni-Mol, OFA, ...)
read ``tgt_len, bsz, embed_dim = query.size()``: time first, batch second, as ``nn.MultiheadAttention`` without
``batch_first``. Given ``(B, T, C)`` such a class attends over the batch, and no mask form of ``(T, T)`` fits its
scores. When no mask form runs as given, the class is probed again with its sequence inputs transposed: every 3-D
tensor argument whose last axis is the model width is passed ``(T, B, C)`` and its output (or the first element of a
tuple) read back as ``(B, T, C)``, by a subclass made for the instance whose forward calls the class's (its code is
unchanged). When that binds, the class is checked so, and ``check -v`` says so.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

NOTE = ("time first: its forward takes (T, B, C) (tgt_len, bsz, embed_dim = query.size(), fairseq's layout), decided "
        "by a probe (given (B, T, C) no mask form ran); its inputs are given transposed and its output read back as "
        "(B, T, C)")


def as_batch_first(module: nn.Module, width: int) -> nn.Module:
    """``module`` taking ``(B, T, C)`` inputs: every 3-D tensor argument whose last axis is ``width`` is passed as
    ``(T, B, C)``, a 3-D output (or a tuple's first element) is returned ``(B, T, C)``."""
    def flip(t):
        return t.transpose(0, 1) if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == width else t

    cls = type(module)

    def forward(self, *args, **kwargs):
        out = cls.forward(self, *(flip(a) for a in args), **{k: flip(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor) and out.dim() == 3:
            return out.transpose(0, 1)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 3:
            return (out[0].transpose(0, 1), *out[1:])
        return out

    forward.__signature__ = inspect.signature(cls.forward)
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__, "attnbench_time_first": True})
    return module
