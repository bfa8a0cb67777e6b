"""Plug-ins for the mask collection (issue 37) with one real bug each; the correctness matrix must flag them.

``MaskBaseline`` is correct: ALiBi, a bidirectional prefix, documents and attention sinks (gpt-oss's per-head
``sinks`` logit in the softmax's denominator), with GQA, windows and non-causal attention, written out step by step.
Every other class changes one line into a bug of a kind that ships in real code, and declares what it supports
through ``attnbench_capabilities`` like a user's class.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def slopes(n: int) -> list[float]:
    """ALiBi's geometric slopes (the paper's rule for a head count that is not a power of two)."""
    def pow2(m: int) -> list[float]:
        return [2 ** (-8 * (h + 1) / m) for h in range(m)]

    if n & (n - 1) == 0:
        return pow2(n)
    m = 2 ** math.floor(math.log2(n))
    return pow2(m) + pow2(2 * m)[0::2][: n - m]


class MaskBaseline(nn.Module):
    """Correct attention with every mask of attnbench.correctness.masks."""

    attnbench_capabilities = {"gqa": True, "sliding_window": True, "non_causal": True, "softcap": True,
                              "masks": True}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True, softcap=None, alibi=False, prefix=None, documents=None, sinks=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.window, self.causal, self.softcap = window, causal, softcap
        self.alibi, self.prefix, self.documents = alibi, prefix, tuple(documents or ())
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))

    def slopes(self) -> list[float]:
        return slopes(self.num_heads)

    def doc(self, pos: torch.Tensor) -> torch.Tensor:
        return sum((pos >= s).long() for s in self.documents) if self.documents else torch.zeros_like(pos)

    def allowed(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        ok = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        if self.causal:
            ok = (j <= i) | (j < self.prefix) if self.prefix else j <= i
        if self.window is not None:
            ok = ok & ((i - j).abs() < self.window)
        return ok & (self.doc(i) == self.doc(j))

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        """Softmax over the keys, the sink logit of each head in the denominator."""
        if not hasattr(self, "sinks"):
            return torch.softmax(scores, dim=-1)
        b, nh, T, _ = scores.shape
        sink = self.sinks.view(1, nh, 1, 1).expand(b, nh, T, 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]

    def forward(self, x):
        b, T, _ = x.shape
        q = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (b, nh, T, T)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        if self.alibi:
            scores = scores - torch.tensor(self.slopes(), dtype=scores.dtype).view(-1, 1, 1) * (i - j).abs()
        scores = scores.masked_fill(~self.allowed(i, j), float("-inf"))
        context = self.weights(scores) @ v
        return self.out_proj(context.transpose(1, 2).reshape(b, T, -1))


class AlibiReversedSlopes(MaskBaseline):
    """ALiBi slopes in reversed head order: head 0 gets the gentlest slope instead of the steepest."""

    def slopes(self):
        return slopes(self.num_heads)[::-1]


class SinkAfterSoftmax(MaskBaseline):
    """The sink logit added to the scores after the softmax (to the weights) instead of joining its denominator."""

    def weights(self, scores):
        w = torch.softmax(scores, dim=-1)
        return w + self.sinks.view(1, -1, 1, 1) * (w > 0) if hasattr(self, "sinks") else w


class PrefixCausal(MaskBaseline):
    """A prefix that is causal instead of bidirectional: the prefix mask is the plain causal one."""

    def allowed(self, i, j):
        ok = j <= i if self.causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        if self.window is not None:
            ok = ok & ((i - j).abs() < self.window)
        return ok & (self.doc(i) == self.doc(j))


class DocumentLeak(MaskBaseline):
    """Document ids off by one (``>`` for ``>=``): each document's first token belongs to the previous document,
    so it sees across the boundary."""

    def doc(self, pos):
        return sum((pos > s).long() for s in self.documents) if self.documents else torch.zeros_like(pos)
