"""Original Meta Llama style: ``forward(x, start_pos, freqs_cis, mask)`` with complex ``freqs_cis`` rotating adjacent
pairs (the interleaved convention) in float32, ``wq``/``wk``/``wv``/``wo`` without biases."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def apply_rotary_emb(xq, xk, freqs_cis):
    # xq, xk: (b, T, heads, head_dim); freqs_cis: (T, head_dim // 2) complex
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[None, :, None, :]
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, start_pos, freqs_cis, mask):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, T, -1))
