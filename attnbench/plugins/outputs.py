"""Which element of a tuple a forward returns is its output (issue 46, round 19), and a dataclass it returns read as
the tuple of its fields (round 20: Chronos-2's ``AttentionOutput(hidden_states, attn_weights)``, a Hugging Face
``ModelOutput``, crashed the mask probe, which compared the objects)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


def output_first(module: nn.Module, args, kwargs, out):
    """A forward that returns its output after something else (TimesFM's ``(scores, output)``) is read with its output
    first: the one element of the tuple shaped like its input but for the last axis, when the first is not."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):  # in its fields' order, the output first
        out = tuple(getattr(out, f.name) for f in dataclasses.fields(out))
    x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if x is None or not isinstance(out, tuple | list) or not out:
        return out
    like = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.shape[:-1] == x.shape[:-1]]
    if len(like) != 1 or like[0] == 0:
        return out
    i = like[0]
    first = (out[i], *out[:i], *out[i + 1:])
    return list(first) if isinstance(out, list) else first
