"""Reproduces the conventions of hkproj/pytorch-transformer ``MultiHeadAttentionBlock`` (no code copied; written for
attnbench's tests).

* ctor ``(d_model: int, h: int, dropout: float)``: the heads under a one-letter name, a required dropout;
* ``forward(q, k, v, mask)``: three input sequences, all required (self-attention passes the same one three times),
  and a required mask where 0 hides, broadcast over batch and heads (the original fills with -1e9, which float16
  cannot hold: here -inf, so that its float16 cases run; that overflow is the original's own).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class QKVInputsAttention(nn.Module):
    def __init__(self, d_model: int, h: int, dropout: float):
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask):
        B = q.shape[0]
        query, key, value = (w(t).view(B, -1, self.h, self.d_k).transpose(1, 2)  # (B, h, T, d_k)
                             for w, t in ((self.w_q, q), (self.w_k, k), (self.w_v, v)))
        scores = query @ key.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, h, T, S)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.w_o((attn @ value).transpose(1, 2).reshape(B, -1, self.h * self.d_k))
