"""One fused q/k/v projection plus an output projection, as Linear and as raw Parameters."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class FusedQKV(nn.Module):
    """``qkv = nn.Linear(d_in, 3*d_out)`` split into q, k, v; ``proj`` mixes the heads."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim, self.d_out, self.dropout = num_heads, d_out // num_heads, d_out, dropout
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)

    def fused(self, x):
        return self.qkv(x)  # (b, T, 3*d_out)

    def forward(self, x):
        b, T, _ = x.shape
        qkv = self.fused(x).view(b, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, b, nh, T, hd)
        q, k, v = qkv.unbind(0)
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                 is_causal=True)  # (b, nh, T, hd)
        return self.proj(context.transpose(1, 2).reshape(b, T, self.d_out))


class FusedQKVUntransposed(FusedQKV):
    """Bug: reshapes the stored (3*d_out, d_in) weight to (d_in, 3*d_out) instead of transposing it."""

    def fused(self, x):
        out = x @ self.qkv.weight.reshape(x.shape[-1], -1)  # runs for every size, wrong for all of them
        return out if self.qkv.bias is None else out + self.qkv.bias


class FusedParams(nn.Module):
    """``Wqkv`` as a raw Parameter of shape (d_in, 3*d_out) used as ``x @ Wqkv``; ``Wo`` likewise (d_out, d_out)."""

    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim, self.d_out = num_heads, d_out // num_heads, d_out
        self.Wqkv = nn.Parameter(torch.randn(d_in, 3 * d_out) / math.sqrt(d_in))
        self.bqkv = nn.Parameter(torch.zeros(3 * d_out)) if qkv_bias else None
        self.Wo = nn.Parameter(torch.randn(d_out, d_out) / math.sqrt(d_out))
        self.bo = nn.Parameter(torch.zeros(d_out))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("future", torch.ones(context_length, context_length, dtype=torch.bool).triu(1),
                             persistent=False)

    def out(self, context):
        return context @ self.Wo + self.bo

    def forward(self, x):
        b, T, _ = x.shape
        qkv = x @ self.Wqkv  # (b, T, 3*d_out)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        q, k, v = (t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for t in qkv.split(self.d_out, -1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (b, nh, T, T)
        weights = self.drop(scores.masked_fill(self.future[:T, :T], float("-inf")).softmax(-1))
        return self.out((weights @ v).transpose(1, 2).reshape(b, T, self.d_out))


class FusedParamsUntransposed(FusedParams):
    """Bug: the output projection uses ``Wo.T``, though ``Wo`` is stored (in, out) like ``Wqkv``."""

    def out(self, context):
        return context @ self.Wo.t() + self.bo
