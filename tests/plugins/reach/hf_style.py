"""Hugging Face's layer conventions (transformers 5), written for attnbench: ``Attention(config, layer_idx)``,
``forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, cache_position=None, **kwargs)``
returning ``(output, weights)``, and a cache *object* the model passes in whose ``update(k, v, layer_idx,
cache_kwargs)`` stores the step's keys and values and returns all of them (``DynamicCache``)."""

import torch
from torch import nn


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, cache_position=None,
                **kwargs):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = (e.unsqueeze(1) for e in position_embeddings)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) * self.head_dim ** -0.5
        if attention_mask is not None:
            scores = scores + attention_mask[..., : k.shape[-2]]
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (weights @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out), weights
