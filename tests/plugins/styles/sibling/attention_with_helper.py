"""A plug-in that imports a helper module from its own folder, as scripts do."""

from __future__ import annotations

from attention_helpers import causal_attention, merge_heads, split_heads  # a sibling file, not a package
from torch import nn


class SiblingImport(nn.Module):
    """Separate q/k/v projections; the attention itself comes from ``attention_helpers.py`` next to this file."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.wq = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.wk = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.wv = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.wo = nn.Linear(d_out, d_out)

    def forward(self, x):
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.wq, self.wk, self.wv))
        return self.wo(merge_heads(causal_attention(q, k, v, self.dropout if self.training else 0.0)))


class SiblingImportUntransposed(SiblingImport):
    """Bug: values as ``x @ wv.weight`` (untransposed)."""

    def forward(self, x):
        q, k = (split_heads(layer(x), self.num_heads) for layer in (self.wq, self.wk))
        v = x @ self.wv.weight
        v = split_heads(v if self.wv.bias is None else v + self.wv.bias, self.num_heads)
        return self.wo(merge_heads(causal_attention(q, k, v, self.dropout if self.training else 0.0)))
