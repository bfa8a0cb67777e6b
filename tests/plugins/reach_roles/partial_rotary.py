"""Rotary embeddings over part of each head (issue 46, round 15; our own code):

- ``NeoXPartialAttention(config)``: GPT-NeoX/Pythia's convention: ``config.rotary_pct`` of each head rotated
  (``rotary_ndims = int(head_size * rotary_pct)``), rotate-half pairs inside that slice, the rest passed through;
  frequencies over the rotated width with ``config.rotary_emb_base``; its fused ``query_key_value`` held per head.
- ``GPTJPartialAttention(embed_dim, num_heads, rotary_dim, max_positions, base=10000)``: GPT-J's: the first
  ``rotary_dim`` dims of each head rotated in interleaved pairs (``rotate_every_two``), no biases.
"""

import math

import torch
from torch import nn


def _inv_freq(width, base):
    return 1.0 / (base ** (torch.arange(0, width, 2, dtype=torch.float64) / width))


class NeoXPartialAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, _inv_freq(self.rotary_ndims, config.rotary_emb_base))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rope(self, x, cos, sin):
        rot, passed = x[..., :self.rotary_ndims], x[..., self.rotary_ndims:]
        return torch.cat((rot * cos + self.rotate_half(rot) * sin, passed), dim=-1)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, t, self.heads, 3 * self.head_size).permute(0, 2, 1, 3)
        q, k, v = qkv.split(self.head_size, dim=-1)
        cos, sin = (c[:t].to(q.dtype) for c in (self.cos_cached, self.sin_cached))
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        w = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_size)
        w = w.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(dim=-1)
        return self.dense((w @ v).permute(0, 2, 1, 3).reshape(b, t, -1))


class GPTJPartialAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, rotary_dim, max_positions, base=10000):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim = num_heads, embed_dim // num_heads, rotary_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim, bias=False)
                                                                for _ in range(4))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), _inv_freq(self.rotary_dim, base))
        self.register_buffer("sincos", torch.cat((freqs.sin(), freqs.cos()), dim=-1), persistent=False)

    @staticmethod
    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    def rope(self, x, sin, cos):
        rot, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + self.rotate_every_two(rot) * sin, passed), dim=-1)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, t, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        sin, cos = self.sincos[:t].to(q.dtype).chunk(2, dim=-1)
        sin, cos = (s.repeat_interleave(2, dim=-1)[:, None] for s in (sin, cos))  # (t, 1, rotary_dim)
        q, k = self.rope(q, sin, cos).transpose(1, 2), self.rope(k, sin, cos).transpose(1, 2)
        w = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        w = w.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(dim=-1)
        return self.out_proj((w @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, -1))
