"""Masks a class takes but does not need, or needs under another name: conventions of the second held-out corpus
(issue 46, round 10), in classes of our own (no code copied).

``MaskedWhenGiven``: ``forward(x, attn_mask=None)``, causal only when the caller passes a ``(T, T)`` additive or bool
mask (mlfoundations/open_clip ``Attention``, as the corpus run described it). ``NeverCausal``: an optional
``attn_bias`` it never applies on this path (facebookresearch/dinov2 ``MemEffAttention`` without xformers): not
causal with any mask. ``RequiredBias``: a required additive ``attn_bias`` (FoundationVision/VAR ``SelfAttention``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MaskedWhenGiven(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.randn(3 * dim, dim) * dim ** -0.5)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim)) if qkv_bias else None
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, t, c = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # True = attend: an additive -inf elsewhere
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out_proj(x.transpose(1, 2).reshape(b, t, c))


class NeverCausal(MaskedWhenGiven):
    def forward(self, x, attn_bias=None):
        return super().forward(x)


class RequiredBias(MaskedWhenGiven):
    def forward(self, x, attn_bias):
        return super().forward(x, attn_mask=attn_bias)
