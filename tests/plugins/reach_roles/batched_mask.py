"""A mask that must be ``(B, T, T)``, one per batch row (issue 46; sooftware/attentions' ``MultiHeadAttention``).

The convention, written here from scratch: ``forward(query, key, value, mask=None)``, q/k/v laid out as
``(B * heads, T, head_dim)``, and a bool mask (True = hidden) of shape ``(B, T, T)`` repeated per head and viewed as
``(B * heads, T, T)``. A ``(T, T)`` or ``(1, T, T)`` mask runs at batch 1 and raises at any other batch, so a causal
probe at batch 1 bound the wrong form and every case with two rows raised.
"""

import math

import torch
from torch import nn


class BatchedMaskAttention(nn.Module):
    def __init__(self, d_model: int = 512, num_heads: int = 8):
        super().__init__()
        self.num_heads, self.d_head = num_heads, d_model // num_heads
        self.query_proj = nn.Linear(d_model, d_model)
        self.key_proj = nn.Linear(d_model, d_model)
        self.value_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.d_head).permute(2, 0, 1, 3).reshape(self.num_heads * b, n, self.d_head)

    def forward(self, query, key, value, mask=None):
        b, t, _ = query.shape
        q, k, v = self._heads(self.query_proj(query)), self._heads(self.key_proj(key)), self._heads(self.value_proj(value))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.d_head)
        if mask is not None:
            mask = mask.unsqueeze(0).repeat(self.num_heads, 1, 1, 1).view(self.num_heads * b, t, -1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = torch.bmm(scores.softmax(-1), v).view(self.num_heads, b, t, self.d_head)
        return self.out_proj(out.permute(1, 2, 0, 3).reshape(b, t, -1))
