"""EAGLE's draft-model ``LlamaAttention`` convention (issue 46, round 20), reproduced in our own code: a config-built
Llama attention whose q, k and v projections take ``2 * hidden_size`` features (the draft layer attends over a token's
embedding and the target model's hidden state, joined), rotary tables built from ``config.rope_theta`` (no theta: no
build), and a required-to-be-causal additive ``(B, 1, T, T)`` mask. Every mask form raised the same shape error, and
the refusal said "not causal with any mask form"; the first cause is the projections' width."""

import math

import torch
from torch import nn


class JoinedStatesAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size, self.num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size * 2, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size * 2, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size * 2, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        q, k, v = (p(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.cos[:q_len].to(q.dtype), self.sin[:q_len].to(q.dtype)
        q, k = ((t * cos) + (torch.cat([-t[..., self.head_dim // 2:], t[..., :self.head_dim // 2]], -1) * sin)
                for t in (q, k))
        weights = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            weights = weights + attention_mask
        out = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.hidden_size))
