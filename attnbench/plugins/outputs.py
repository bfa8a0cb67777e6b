"""Which element of a tuple a forward returns is its output (issue 46, round 19)."""

from __future__ import annotations

import torch
from torch import nn


def output_first(module: nn.Module, args, kwargs, out):
    """A forward that returns its output after something else (TimesFM's ``(scores, output)``) is read with its output
    first: the one element of the tuple shaped like its input but for the last axis, when the first is not."""
    x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if x is None or not isinstance(out, tuple | list) or not out:
        return out
    like = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.shape[:-1] == x.shape[:-1]]
    if len(like) != 1 or like[0] == 0:
        return out
    i = like[0]
    first = (out[i], *out[:i], *out[i + 1:])
    return list(first) if isinstance(out, list) else first
