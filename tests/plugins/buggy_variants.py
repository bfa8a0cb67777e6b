"""Plug-ins for attention variants and KV caches with one real bug each; the correctness matrix must flag them.

``GQABaseline`` and ``CacheBaseline`` are correct (grouped-query attention with an optional sliding
window; a preallocated KV cache with a position pointer and a growing cache). Every other class
changes one line into a bug of a kind that ships in real code. Like a user's class they take the
book's constructor plus ``num_kv_heads``, ``window`` and ``causal``, and declare what they support
through ``attnbench_capabilities``.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class GQABaseline(nn.Module):
    """Correct grouped-query attention with an optional sliding window (causal), written out step by step."""

    # it takes ``causal`` but is always causal: declared, since a ``causal`` parameter says non-causal otherwise
    attnbench_capabilities = {"gqa": True, "sliding_window": True, "non_causal": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.window, self.context_length = window, context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def heads(self, t, n):
        b, T, _ = t.shape
        return t.view(b, T, n, self.head_dim).transpose(1, 2)  # (b, n, T, hd)

    def expand_kv(self, t):
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (b, nh, T, hd)

    def allowed(self, q_pos, k_pos):
        """Query positions (T_q, 1) x key positions (1, T_k) -> True where attending is allowed."""
        ok = k_pos <= q_pos
        if self.window is not None:
            ok = ok & (q_pos - k_pos < self.window)
        return ok

    def attend(self, q, k, v, q_pos, k_pos):
        k, v = self.expand_kv(k), self.expand_kv(v)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (b, nh, T_q, T_k)
        scores = scores.masked_fill(~self.allowed(q_pos, k_pos), float("-inf"))
        b, _, T, _ = q.shape
        context = torch.softmax(scores, dim=-1) @ v  # (b, nh, T_q, hd)
        return self.out_proj(context.transpose(1, 2).reshape(b, T, -1))

    def forward(self, x):
        q = self.heads(self.W_query(x), self.num_heads)
        k = self.heads(self.W_key(x), self.num_kv_heads)
        v = self.heads(self.W_value(x), self.num_kv_heads)
        pos = torch.arange(x.shape[1])
        return self.attend(q, k, v, pos[:, None], pos[None, :])


class WrongKVMapping(GQABaseline):
    """Bug: K/V expanded with repeat (query head h reads kv head h % num_kv_heads) instead of repeat_interleave."""

    def expand_kv(self, t):
        return t.repeat(1, self.num_heads // self.num_kv_heads, 1, 1)


class WindowOffByOne(GQABaseline):
    """Bug: the window keeps q - k <= w (w + 1 tokens) instead of q - k < w."""

    def allowed(self, q_pos, k_pos):
        ok = k_pos <= q_pos
        if self.window is not None:
            ok = ok & (q_pos - k_pos <= self.window)
        return ok


class CacheBaseline(GQABaseline):
    """Correct KV cache: preallocated buffers of context_length and a position pointer (full attention only)."""

    attnbench_capabilities = {"gqa": True, "kv_cache": True, "sliding_window": False, "non_causal": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)
        self.reset_cache()

    def reset_cache(self):
        self.pos = 0
        self.cache_k = self.cache_v = None

    def rewind_cache(self, n=1):
        self.pos -= n

    def cache_tensors(self):
        return [t for t in (self.cache_k, self.cache_v) if t is not None]

    def slot(self, t):
        """Where the next ``t`` tokens are written."""
        return slice(self.pos, self.pos + t)

    def forward(self, x, use_cache=False):
        if not use_cache:
            return super().forward(x)
        b, t, _ = x.shape
        q = self.heads(self.W_query(x), self.num_heads)
        k = self.heads(self.W_key(x), self.num_kv_heads)
        v = self.heads(self.W_value(x), self.num_kv_heads)
        if self.cache_k is None:
            shape = (b, self.num_kv_heads, self.context_length, self.head_dim)
            self.cache_k, self.cache_v = torch.zeros(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)
        where = self.slot(t)
        self.cache_k[:, :, where], self.cache_v[:, :, where] = k, v
        end = self.pos + t
        q_pos = torch.arange(self.pos, end)[:, None]
        self.pos = end
        return self.attend(q, self.cache_k[:, :, :end], self.cache_v[:, :, :end], q_pos, torch.arange(end)[None, :])


class CachePositionOffByOne(CacheBaseline):
    """Bug: after the prefill, new tokens are written one slot too far (pos + 1), leaving a zero key/value behind."""

    def slot(self, t):
        start = self.pos + 1 if self.pos else 0
        return slice(start, start + t)


class GrowingCacheBaseline(GQABaseline):
    """Correct growing cache (torch.cat), the book's chapter-4 style."""

    attnbench_capabilities = {"gqa": True, "kv_cache": True, "sliding_window": False, "non_causal": False}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)
        self.reset_cache()

    def reset_cache(self):
        self.cache_k = self.cache_v = None
        self.pos = 0

    def rewind_cache(self, n=1):
        self.pos -= n
        self.cache_k, self.cache_v = self.cache_k[:, :, :-n], self.cache_v[:, :, :-n]

    def forward(self, x, use_cache=False):
        if not use_cache:
            return super().forward(x)
        t = x.shape[1]
        q = self.heads(self.W_query(x), self.num_heads)
        k = self.heads(self.W_key(x), self.num_kv_heads)
        v = self.heads(self.W_value(x), self.num_kv_heads)
        if self.cache_k is not None:
            k, v = torch.cat([self.cache_k, k], dim=2), torch.cat([self.cache_v, v], dim=2)
        self.cache_k, self.cache_v = k, v
        q_pos = torch.arange(self.pos, self.pos + t)[:, None]
        self.pos += t
        k_pos = torch.arange(self.pos - k.shape[2], self.pos)[None, :]
        return self.attend(q, k, v, q_pos, k_pos)


class CacheNotClearedOnReset(GrowingCacheBaseline):
    """Bug: reset_cache() rewinds the position but keeps the cached keys and values of the previous sequence."""

    def reset_cache(self):
        self.pos = 0
        if not hasattr(self, "cache_k"):
            self.cache_k = self.cache_v = None
