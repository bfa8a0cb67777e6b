"""Reproduces the conventions of state-spaces/mamba ``mamba_ssm.modules.mha.MHA`` (no code copied; written for
attnbench's tests).

* ctor ``(embed_dim, num_heads, num_heads_kv=None, qkv_proj_bias=True, out_proj_bias=True, causal=False,
  rotary_emb_dim=0, rotary_emb_base=10000.0)``: the kv heads and the q/k/v bias switch under names no table holds
  (their effects say what they are); causal only by the flag;
* a rotary base taken but unused as built (``rotary_emb_dim=0``: nothing rotates), so it is no evidence of RoPE;
* one fused ``in_proj`` of q, then keys and values as ``(two, kv_heads, head_dim)``; each kv head repeated in place
  for its query heads (``repeat_interleave``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class BiasFlagAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, num_heads_kv=None, qkv_proj_bias=True, out_proj_bias=True, causal=False,
                 rotary_emb_dim=0, rotary_emb_base=10000.0):
        super().__init__()
        if rotary_emb_dim > 0:
            raise NotImplementedError("rotary embeddings are not reproduced here")
        self.num_heads, self.head_dim, self.causal, self.base = num_heads, embed_dim // num_heads, causal, rotary_emb_base
        self.kv_heads = num_heads_kv or num_heads
        self.in_proj = nn.Linear(embed_dim, embed_dim + 2 * self.kv_heads * self.head_dim, bias=qkv_proj_bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias)

    def forward(self, x, inference_params=None):
        B, T, C = x.shape  # (B, T, C)
        q, kv = self.in_proj(x).split([C, 2 * self.kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, h, T, d)
        k, v = kv.view(B, T, 2, self.kv_heads, self.head_dim).unbind(dim=2)  # (B, T, h_kv, d) each
        r = self.num_heads // self.kv_heads
        k, v = (t.transpose(1, 2).repeat_interleave(r, dim=1) for t in (k, v))  # (B, h, T, d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, C))
