"""A cache passed in and returned, under a name of its own: ``forward(x, past_kv=None, use_cache=False)`` returning
``(y, present)`` (the convention of suno-ai/bark ``CausalSelfAttention``, second held-out corpus, round 10, as its run
described it; a class of our own, no code copied, with its dropout off in eval mode)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class PastKVAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout=0.0, bias=True):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x, past_kv=None, use_cache=False):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        if past_kv is not None:
            k, v = torch.cat((past_kv[0], k), dim=-2), torch.cat((past_kv[1], v), dim=-2)
        present = (k, v) if use_cache else None
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=past_kv is None)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c)), present
