"""Hugging Face style, owning its rotary tables: ``Attention(config)`` reads ``rope_theta`` and
``max_position_embeddings`` (and a Llama-3 ``rope_scaling`` dict),
builds ``inv_freq`` in ``__init__`` and rotates inside ``forward(hidden_states)``."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def llama3_inv_freq(inv_freq, scaling):
    # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between
    low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"])
    blended = (1 - smooth) * inv_freq / scaling["factor"] + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling["factor"], inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, out)


class RotaryEmbedding(nn.Module):
    # Hugging Face's numerics: inv_freq computed in float32 in __init__ (a buffer the module's cast turns into float64
    # holding float32 numbers), the angles, cos and sin computed in float32 in forward, then cast to x's dtype
    def __init__(self, dim, max_position_embeddings, base=10000.0, scaling=None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if scaling is not None and scaling.get("rope_type") == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        positions = torch.arange(seq_len, device=x.device).float()
        freqs = torch.outer(positions, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, base=self.theta(config),
                                          scaling=getattr(config, "rope_scaling", None))

    def theta(self, config):
        return config.rope_theta

    def forward(self, hidden_states):
        b, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, seq_len=T)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1))


class ThetaIgnored(RotaryAttention):
    """Bug: reads rope_theta but builds its tables with 10,000 whatever it is given."""

    def theta(self, config):
        _ = config.rope_theta
        return 10000.0
