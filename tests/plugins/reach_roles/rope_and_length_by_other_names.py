"""Rotary tables under the name ``rope``, a required ``max_seq_length``, a cache tuple passed in and returned.

Reproduces the convention of Lightning-AI/lit-llama ``lit_llama/model.py:CausalSelfAttention`` (commit 2a464de): the
constructor takes its own config dataclass (``block_size``, ``n_head``, ``n_embd``); a fused ``c_attn`` and ``c_proj``
without bias; ``forward(x, rope, mask, max_seq_length, input_pos=None, kv_cache=None)`` with ``rope`` a real table
``(T_total, head_dim/2, 2)`` of (cos, sin) sliced to the first T rows (pairs interleaved), ``mask`` a REQUIRED bool
keep-mask ``(1, 1, T, T_k)`` (the only source of causality), ``max_seq_length`` a REQUIRED int, ``input_pos`` a
LongTensor of positions and ``kv_cache`` a pair of ``(B, H, T_max, D)`` tensors updated with ``index_copy`` at
``input_pos`` and returned: it returns ``(y, kv_cache)``. The rotation is computed in float32 whatever the input dtype.
Our own code, written for attnbench's tests.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PairConfig:
    block_size: int = 1024
    n_layer: int = 1
    n_head: int = 8
    n_embd: int = 512


def turn_pairs(x, rope):
    t = x.size(1)
    table = rope[:t].view(1, t, 1, -1, 2)
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = table[..., 0], table[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(3).type_as(x)


class RopeArgAttention(nn.Module):
    def __init__(self, config: PairConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rope, mask, max_seq_length, input_pos=None, kv_cache=None):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hd = c // self.n_head
        q = turn_pairs(q.view(b, t, self.n_head, hd), rope).transpose(1, 2)
        k = turn_pairs(k.view(b, t, self.n_head, hd), rope).transpose(1, 2)
        v = v.view(b, t, self.n_head, hd).transpose(1, 2)
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            k = cache_k.index_copy(2, input_pos, k)
            v = cache_v.index_copy(2, input_pos, v)
            kv_cache = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c)), kv_cache
