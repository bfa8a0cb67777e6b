"""Reproduces the conventions of zhouhaoyi/Informer2020 ``models/attn.py``: ``AttentionLayer(attention, d_model,
n_heads, ...)`` projects q, k and v and calls an inner attention module its caller builds; ``FullAttention`` is that
inner attention, with no weights, over queries, keys and values already projected and split per head. Our own code,
written for attnbench's tests."""
import math

import torch
from torch import nn


class KernelOnly(nn.Module):
    def __init__(self, causal=True, dropout=0.1):
        super().__init__()
        self.causal = causal
        self.drop = nn.Dropout(dropout)

    def forward(self, queries, keys, values, mask):
        b, t, h, e = queries.shape
        scores = torch.einsum("blhe,bshe->bhls", queries, keys) / math.sqrt(e)
        if self.causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhls,bshd->blhd", self.drop(scores.softmax(-1)), values), None


class AroundInner(nn.Module):
    def __init__(self, attention, d_model, n_heads):
        super().__init__()
        self.inner_attention = attention
        self.query_projection = nn.Linear(d_model, d_model)
        self.key_projection = nn.Linear(d_model, d_model)
        self.value_projection = nn.Linear(d_model, d_model)
        self.out_projection = nn.Linear(d_model, d_model)
        self.n_heads = n_heads

    def forward(self, queries, keys, values, attn_mask):
        b, t, _ = queries.shape
        q = self.query_projection(queries).view(b, t, self.n_heads, -1)
        k = self.key_projection(keys).view(b, t, self.n_heads, -1)
        v = self.value_projection(values).view(b, t, self.n_heads, -1)
        out, _ = self.inner_attention(q, k, v, attn_mask)
        return self.out_projection(out.reshape(b, t, -1))
