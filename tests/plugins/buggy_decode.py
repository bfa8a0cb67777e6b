"""KV caches in the styles real decoders use, and one bug per decode pattern the decode property checks.

``ChapterFourCache`` (a growing ``torch.cat`` cache with a position pointer into a causal-mask buffer, the
book's chapter-4 style) and ``RingCache`` (a ring of ``window`` slots for sliding-window attention, a
preallocated cache without a window) are correct. Every other class changes a few lines into a bug that
prefill + token-by-token decoding does not see, and only one of the newer patterns does:

* ``MultiTokenMeansPrefill``: a call with several tokens is taken for a prefill (causal mask from position 0),
  so a chunk appended to a non-empty cache attends to the wrong keys (pattern: uneven chunks);
* ``RingDropsWrappedTokens``: a chunk is written into the ring as one contiguous slice, so the tokens that
  would wrap around to slot 0 are never stored (pattern: a chunk across the window's wrap-around);
* ``CachedDropoutInEval``: the cached path applies ``F.dropout`` with its default ``training=True``
  (pattern: eval mode with dropout);
* ``RingKeepsFirstBatch``: ``reset_cache()`` keeps the buffers allocated for the first batch size
  (pattern: another batch size after ``reset_cache()``).

Like a user's class they take the book's constructor (plus ``window``) and declare what they support.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class ChapterFourCache(nn.Module):
    """The book's chapter-4 KV cache style: ``cache_k``/``cache_v`` grown with ``torch.cat``, ``ptr_current_pos``."""

    attnbench_capabilities = {"kv_cache": True}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1), persistent=False)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0

    def rewind_cache(self, n=1):
        self.cache_k, self.cache_v = self.cache_k[:, :, :-n], self.cache_v[:, :, :-n]
        self.ptr_current_pos -= n

    def split(self, t):
        b, T, _ = t.shape
        return t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # (b, nh, T, hd)

    def mask_for(self, num_q, num_k, use_cache):
        """True where attending is not allowed: rows are the queries' positions in the sequence."""
        if use_cache:
            start = self.ptr_current_pos
            return self.mask.bool()[start:start + num_q, :num_k]
        return self.mask.bool()[:num_q, :num_k]

    def attention_dropout(self, weights):
        return self.dropout(weights)

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        queries = self.split(self.W_query(x))
        keys_new, values_new = self.split(self.W_key(x)), self.split(self.W_value(x))
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=2)  # (b, nh, L, hd)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=2)
            keys, values = self.cache_k, self.cache_v
        else:
            keys, values = keys_new, values_new
        attn_scores = queries @ keys.transpose(2, 3)  # (b, nh, T, L)
        attn_scores = attn_scores.masked_fill(self.mask_for(num_tokens, keys.shape[2], use_cache), -torch.inf)
        if use_cache:
            self.ptr_current_pos += num_tokens
        attn_weights = self.attention_dropout(torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1))
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)  # (b, T, d_out)
        return self.out_proj(context)


class MultiTokenMeansPrefill(ChapterFourCache):
    """Bug: a call of several tokens is taken for a prefill, so its causal mask starts at position 0."""

    def mask_for(self, num_q, num_k, use_cache):
        if use_cache and num_q == 1:
            return super().mask_for(num_q, num_k, use_cache)
        return self.mask.bool()[:num_q, :num_k]


class CachedDropoutInEval(ChapterFourCache):
    """Bug: the cached path calls ``F.dropout(weights, p)``, whose ``training`` defaults to True."""

    def forward(self, x, use_cache=False):
        self._cached = use_cache
        return super().forward(x, use_cache)

    def attention_dropout(self, weights):
        if self._cached:
            return F.dropout(weights, self.dropout.p)
        return self.dropout(weights)


class RingCache(nn.Module):
    """Sliding-window attention with a ring of ``window`` K/V slots (``context_length`` slots without a window).

    Token p lives in slot ``p % slots``; ``slot_pos`` records which position each slot holds. A call attends over
    the ring as it was plus its own keys, then stores its keys, so a chunk never overwrites keys its own
    earlier tokens still need.
    """

    attnbench_capabilities = {"kv_cache": True, "sliding_window": True, "gqa": True}

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.window, self.context_length = window, context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.cache_k = self.cache_v = self.slot_pos = None
        self.reset_cache()

    @property
    def slots(self):
        return min(self.window or self.context_length, self.context_length)

    def reset_cache(self):
        self.cache_k = self.cache_v = self.slot_pos = None
        self.pos = 0

    def rewind_cache(self, n=1):
        assert n == 1, "a ring rewinds one token at a time"
        self.pos -= 1
        self.slot_pos[self.pos % self.slots] = -1

    def heads(self, t, n):
        b, T, _ = t.shape
        return t.view(b, T, n, self.head_dim).transpose(1, 2)  # (b, n, T, hd)

    def attend(self, q, k, v, q_pos, k_pos):
        """q (b, nh, t, hd) over k/v (b, n_kv, L, hd); positions q_pos (t, 1), k_pos (1, L) (-1: empty slot)."""
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (b, nh, L, hd)
        ok = (k_pos >= 0) & (k_pos <= q_pos)
        if self.window is not None:
            ok = ok & (q_pos - k_pos < self.window)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (b, nh, t, L)
        weights = self.dropout(torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1))
        b, _, t, _ = q.shape
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, -1))  # (b, t, d_out)

    def allocate(self, b, like):
        if self.cache_k is None:
            shape = (b, self.num_kv_heads, self.slots, self.head_dim)
            self.cache_k, self.cache_v = like.new_zeros(shape), like.new_zeros(shape)
            self.slot_pos = torch.full((self.slots,), -1, dtype=torch.long, device=like.device)

    def store(self, k, v, new_pos):
        """Write the last ``slots`` of the new tokens to slots ``p % slots``."""
        keep = min(k.shape[2], self.slots)
        idx = new_pos[-keep:] % self.slots
        self.cache_k[:, :, idx], self.cache_v[:, :, idx] = k[:, :, -keep:], v[:, :, -keep:]
        self.slot_pos[idx] = new_pos[-keep:]

    def forward(self, x, use_cache=False):
        b, t, _ = x.shape
        q = self.heads(self.W_query(x), self.num_heads)
        k, v = self.heads(self.W_key(x), self.num_kv_heads), self.heads(self.W_value(x), self.num_kv_heads)
        pos = torch.arange(t, device=x.device)
        if not use_cache:
            return self.attend(q, k, v, pos[:, None], pos[None, :])
        self.allocate(b, k)
        new_pos = self.pos + pos
        keys, values = torch.cat([self.cache_k, k], dim=2), torch.cat([self.cache_v, v], dim=2)  # ring + new
        key_pos = torch.cat([self.slot_pos, new_pos])
        out = self.attend(q, keys, values, new_pos[:, None], key_pos[None, :])
        self.store(k, v, new_pos)
        self.pos += t
        return out


class RingDropsWrappedTokens(RingCache):
    """Bug: a chunk appended to a non-empty ring is stored as one contiguous slice from slot ``pos % slots``, so
    its tokens that would wrap around to slot 0 are lost (the prefill and single tokens are stored right)."""

    def store(self, k, v, new_pos):
        if self.pos == 0 or k.shape[2] == 1:
            return super().store(k, v, new_pos)
        start = int(new_pos[0]) % self.slots
        n = min(k.shape[2], self.slots - start)
        self.cache_k[:, :, start:start + n], self.cache_v[:, :, start:start + n] = k[:, :, :n], v[:, :, :n]
        self.slot_pos[start:start + n] = new_pos[:n]


class RingKeepsFirstBatch(RingCache):
    """Bug: ``reset_cache()`` keeps the buffers allocated for the first batch size (only the pointer is reset)."""

    def reset_cache(self):
        if self.slot_pos is not None:
            self.slot_pos.fill_(-1)
        self.pos = 0
