"""Chapter-4 style multi-head latent attention: ``W_query``, ``W_DKV`` down to a latent, ``W_UK``/``W_UV`` up, and a
KV cache that holds the latent (``cache_c_kv``) instead of keys and values; ``forward(x, use_cache=False)``,
``reset_cache()``."""

from __future__ import annotations

import torch
from torch import nn


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, latent_dim=None):
        super().__init__()
        assert d_out % num_heads == 0
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.latent_dim = latent_dim or max(16, d_out // 8)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_DKV = nn.Linear(d_in, self.latent_dim, bias=qkv_bias)
        self.W_UK = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)
        self.W_UV = nn.Linear(self.latent_dim, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("cache_c_kv", None, persistent=False)
        self.ptr_current_pos = 0

    def reset_cache(self):
        self.cache_c_kv, self.ptr_current_pos = None, 0

    def latent(self, c_new, use_cache):
        if not use_cache:
            return c_new
        self.cache_c_kv = c_new if self.cache_c_kv is None else torch.cat([self.cache_c_kv, c_new], dim=1)
        return self.cache_c_kv

    def split(self, t):
        b, T, _ = t.shape
        return t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, heads, T, head_dim)

    def forward(self, x, use_cache=False):
        b, T, _ = x.shape
        c_kv = self.latent(self.W_DKV(x), use_cache)  # (b, T_total, latent)
        q, k, v = self.split(self.W_query(x)), self.split(self.W_UK(c_kv)), self.split(self.W_UV(c_kv))
        start = self.ptr_current_pos if use_cache else 0
        self.ptr_current_pos = start + T if use_cache else 0
        q_pos = torch.arange(start, start + T, device=x.device)[:, None]
        k_pos = torch.arange(k.shape[2], device=x.device)[None, :]
        if not use_cache:
            q_pos = torch.arange(T, device=x.device)[:, None]
        scores = (q @ k.transpose(2, 3)).masked_fill(k_pos > q_pos, -torch.inf)
        weights = self.dropout(torch.softmax(scores / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, T, self.d_out))


class LatentOfEarlierStepsDropped(MultiHeadLatentAttention):
    """Bug: the cache keeps only the newest call's latent (the keys and values of earlier steps are lost)."""

    def latent(self, c_new, use_cache):
        if use_cache:
            self.cache_c_kv = c_new
        return c_new
