"""GPT-2's convention: transposed ``Conv1D`` projections, and a score scale switched on by a constructor flag.

Reproduces the convention of OpenAI's GPT-2 attention as its PyTorch ports write it (graykode/gpt-2-Pytorch
``GPT2/model.py:Attention``, Hugging Face's ``Conv1D``): ``__init__(nx, n_ctx, config, scale=False)`` where the model
always passes ``scale=True`` (built with the default, the scores are unscaled); projections are ``Conv1D(n_out, n_in)``
modules whose weight is stored ``(in, out)`` and applied with ``torch.addmm`` on ``x.view(-1, C)`` (so a non-contiguous
input raises); one fused q/k/v projection split by width; keys split already transposed ``(B, H, D, T)``; a causal
buffer ``(1, 1, n_ctx, n_ctx)`` of ones below the diagonal applied as ``w * b - 1e10 * (1 - b)``; it returns ``(out,
present)``. Our own code, written for attnbench's tests.
"""
import math
from types import SimpleNamespace

import torch
from torch import nn


class TransposedLinear(nn.Module):
    """``y = x W + b`` with ``W`` stored (in, out): GPT-2's ``Conv1D(nf, nx)``."""

    def __init__(self, n_out, n_in):
        super().__init__()
        self.n_out = n_out
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        flat = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return flat.view(*x.shape[:-1], self.n_out)


class ScaleFlagAttention(nn.Module):
    def __init__(self, nx, n_ctx, config, scale=False):
        super().__init__()
        self.heads = config.n_head
        self.width = nx
        self.scale = scale
        self.register_buffer("tri", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.c_attn = TransposedLinear(3 * nx, nx)
        self.c_proj = TransposedLinear(nx, nx)

    def _split(self, t, keys=False):
        t = t.view(*t.shape[:-1], self.heads, t.shape[-1] // self.heads)
        return t.permute(0, 2, 3, 1) if keys else t.permute(0, 2, 1, 3)

    def forward(self, x, layer_past=None):
        q, k, v = self.c_attn(x).split(self.width, dim=2)
        q, k, v = self._split(q), self._split(k, keys=True), self._split(v)
        if layer_past is not None:
            k = torch.cat((layer_past[0].transpose(-2, -1), k), dim=-1)
            v = torch.cat((layer_past[1], v), dim=-2)
        present = torch.stack((k.transpose(-2, -1), v))
        w = q @ k
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        nq, nk = w.size(-2), w.size(-1)
        b = self.tri[:, :, nk - nq:nk, :nk]
        w = torch.softmax(w * b - 1e10 * (1 - b), dim=-1)
        a = (w @ v).permute(0, 2, 1, 3).contiguous()
        return self.c_proj(a.view(*a.shape[:-2], self.width)), present


def config(n_head=4):
    """What the model passes as ``config`` (only ``n_head`` is read)."""
    return SimpleNamespace(n_head=n_head)
