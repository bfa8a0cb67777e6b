"""Salesforce uni2ts ``GroupedQueryAttention``'s convention: QK-norm by ``nn.LayerNorm(head_dim)`` modules named
``q_norm``/``k_norm``, with biases. The reference's QK-norm has a gain and no bias, so the biases cannot be mapped:
the refusal says so, and does not call the class a sublayer (its norms are the q/k norms). Our own code."""

import torch.nn.functional as F
from torch import nn


class LayerNormQK(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.nh, self.hd = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.q_norm, self.k_norm = nn.LayerNorm(self.hd), nn.LayerNorm(self.hd)
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = (p(x).view(b, T, self.nh, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, T, -1))
