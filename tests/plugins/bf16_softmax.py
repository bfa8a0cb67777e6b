"""Issue 38's planted accuracy bug: a softmax kept in bfloat16 while the layer's inputs are float32.

``Bfloat16Softmax`` rounds the attention scores to bfloat16 before the softmax and the attention weights to bfloat16
after it (as a kernel that accumulates the softmax in bfloat16 would): its float32 output is off by about 1e-3, which
a loose fixed tolerance (bfloat16's 2e-2) lets through, but its error is hundreds of times what float32 costs.
``Float32Softmax`` is the same code with the round trips through float32 (the same copies, so the same time): the
correct implementation the planted one is compared against. Load them as ``tests/plugins/bf16_softmax.py:Bfloat16Softmax``
(with a shared name, ``attn=tests/plugins/bf16_softmax.py:Float32Softmax``, two runs compare cell by cell).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Float32Softmax(nn.Module):
    """Causal multi-head attention whose softmax rounds through ``ROUND`` (float32 here: no loss)."""

    ROUND = torch.float32

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim, self.d_out = num_heads, d_out // num_heads, d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, T, _ = t.shape
        return t.reshape(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = self._heads(self.W_query(x)), self._heads(self.W_key(x)), self._heads(self.W_value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (b, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        rounded = scores.to(self.ROUND, copy=True).to(x.dtype, copy=True)  # the bug: logits kept in ROUND
        weights = torch.softmax(rounded, dim=-1).to(self.ROUND, copy=True).to(x.dtype, copy=True)  # and probabilities
        context = (self.dropout(weights) @ v).transpose(1, 2).reshape(b, T, self.d_out)
        return self.out_proj(context)


class Bfloat16Softmax(Float32Softmax):
    """The planted bug: the softmax's scores and weights rounded to bfloat16 in a float32 layer."""

    ROUND = torch.bfloat16
