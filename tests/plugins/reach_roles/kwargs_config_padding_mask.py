"""A Hugging Face config subclass that reads its sizes from ``**kwargs``; a padding mask; a tuple cache returned.

Reproduces the convention of jingyaogong/minimind ``model/model_minimind.py:Attention`` (commit d65ef2c): the
constructor takes one config, a ``transformers.PretrainedConfig`` subclass whose ``__init__(hidden_size=..., **kwargs)``
reads ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps`` ... from ``kwargs`` (they are
not dataclass fields); q/k/v/o projections without bias and a per-head RMSNorm with weights on q and k;
``forward(x, position_embeddings, past_key_value=None, use_cache=False, attention_mask=None)``: ``(cos, sin)`` each
``(T, head_dim)`` (rotate-half form), the cache a tuple ``(k, v)`` of ``(B, T, H_kv, D)`` concatenated on dim 1,
``attention_mask`` a ``(B, T_k)`` padding mask (1 = keep); causal always; returns ``(out, past_kv)`` (``past_kv`` None
unless ``use_cache``). Our own code, written for attnbench's tests.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig


class KwargsConfig(PretrainedConfig):
    model_type = "reach_roles_kwargs"

    def __init__(self, hidden_size=512, num_hidden_layers=2, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = kwargs.get("num_attention_heads", 8)
        self.num_key_value_heads = kwargs.get("num_key_value_heads", 4)
        self.head_dim = kwargs.get("head_dim", hidden_size // self.num_attention_heads)
        self.rms_norm_eps = kwargs.get("rms_norm_eps", 1e-6)
        self.rope_theta = kwargs.get("rope_theta", 1e6)
        self.max_position_embeddings = kwargs.get("max_position_embeddings", 4096)


class HeadRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def half_turn(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class KwargsConfigAttention(nn.Module):
    def __init__(self, config: KwargsConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = HeadRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, position_embeddings, past_key_value=None, use_cache=False, attention_mask=None):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        cos, sin = (e.unsqueeze(1) for e in position_embeddings)  # (T, 1, D) against (B, T, H, D)
        q, k = q * cos + half_turn(q) * sin, k * cos + half_turn(k) * sin
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=1)
            v = torch.cat([past_key_value[1], v], dim=1)
        past = (k, v) if use_cache else None
        rep = self.heads // self.kv_heads
        q, k, v = q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores[:, :, :, -t:] += torch.full((t, t), float("-inf"), dtype=scores.dtype).triu(1)
        if attention_mask is not None:
            scores = scores + (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * -1e9
        out = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out), past
