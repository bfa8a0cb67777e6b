"""A fused q/k/v weight named ``mat_qkv`` whose bias is assembled in forward from a query bias, a zero key-bias buffer
and a value bias, and a required additive ``attn_bias`` (the convention of FoundationVision/VAR ``SelfAttention``,
second held-out corpus, round 10; a class of our own, no code copied, with the usual 1/sqrt(head_dim) scale where
VAR's is 0.25/sqrt(head_dim))."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class SplitBiasAttention(nn.Module):
    def __init__(self, block_idx, embed_dim=768, num_heads=12, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scale, self.attn_drop = 1 / math.sqrt(self.head_dim), attn_drop
        self.mat_qkv = nn.Linear(embed_dim, embed_dim * 3, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(embed_dim)), nn.Parameter(torch.zeros(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, attn_bias):
        b, t, c = x.shape
        qkv = F.linear(x, self.mat_qkv.weight, torch.cat((self.q_bias, self.zero_k_bias, self.v_bias)))
        q, k, v = qkv.view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale,
                                           dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj(o.transpose(1, 2).reshape(b, t, c))
