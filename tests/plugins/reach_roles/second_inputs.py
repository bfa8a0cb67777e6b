"""Second inputs: a forward that takes its queries, keys and values apart, and cross-attention (written for attnbench's
tests; no code copied).

* ``QueryKeyValueAttention``: ``nn.MultiheadAttention``'s convention: ``forward(query, key, value, attn_mask=None,
  need_weights=True)`` returning ``(out, weights)``; ``in_proj_weight``/``in_proj_bias`` and ``out_proj``; a bool mask,
  True = hidden. Correct causal self-attention when ``key`` and ``value`` are the query sequence and the mask is causal.
* ``CrossAttention``: CompVis/stable-diffusion's convention (``ldm.modules.attention.CrossAttention``) with the context
  required: ctor ``(query_dim, context_dim, heads, dim_head)``, ``to_q`` on x, ``to_k``/``to_v`` on ``context``;
  ``mask`` a ``(B, S)`` key-padding mask (True = keep). As self-attention (``context_dim = query_dim``, ``context = x``)
  it has no causal form: refused as cross-attention, not causal.
* ``MaskedCrossAttention``: the same with ``mask`` an attention mask ``(T, S)`` (True = keep): as self-attention it is
  a correct causal attention, and passes.
* ``DefaultWidthCrossAttention``: ``context_dim=40`` by default, an optional int: built with ``d_in`` it is
  self-attention (its weights say so), and passes.
* ``FixedWidthCrossAttention``: its context is always ``CONTEXT_WIDTH`` wide (an encoder's, not a parameter): it
  cannot be self-attention, and is refused as cross-attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QueryKeyValueAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) * embed_dim ** -0.5)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None, need_weights=True):
        w, b = self.in_proj_weight.chunk(3), (self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3)
        B, T, _ = query.shape
        q, k, v = (F.linear(t, wi, bi).view(B, t.shape[1], self.num_heads, -1).transpose(1, 2)
                   for t, wi, bi in zip((query, key, value), w, b, strict=True))
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, float("-inf"))
        weights = scores.softmax(-1)
        out = self.out_proj((weights @ v).transpose(1, 2).reshape(B, T, -1))
        return out, (weights.mean(1) if need_weights else None)


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim, heads=8, dim_head=64):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def scores(self, x, context):
        b = x.shape[0]
        q, k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
        return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, v

    def forward(self, x, context, mask=None):
        sim, v = self.scores(x, context)
        if mask is not None:  # (B, S) key padding
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        out = (sim.softmax(-1) @ v).transpose(1, 2)
        return self.to_out(out.reshape(*out.shape[:2], -1))


class MaskedCrossAttention(CrossAttention):
    def forward(self, x, context, mask):
        sim, v = self.scores(x, context)
        sim = sim.masked_fill(~mask, float("-inf"))  # (T, S), True = keep
        out = (sim.softmax(-1) @ v).transpose(1, 2)
        return self.to_out(out.reshape(*out.shape[:2], -1))


class FixedWidthCrossAttention(MaskedCrossAttention):
    CONTEXT_WIDTH = 40

    def __init__(self, dim, heads=8, dim_head=64):
        super().__init__(dim, self.CONTEXT_WIDTH, heads, dim_head)


class DefaultWidthCrossAttention(MaskedCrossAttention):
    def __init__(self, dim, heads=8, dim_head=64, context_dim=40):
        super().__init__(dim, context_dim, heads, dim_head)
