"""Chapter-4-style KV caches with one bug each (no ``rewind_cache``: the decode timer restores their state).

The first two compute wrong decode outputs and must be flagged by the decode property even though a
restore runs in the middle of it; the others must be refused when they load, with one line each.
"""

from __future__ import annotations

import torch
from kv_growing import MultiHeadAttention
from torch import nn

_CACHES: dict[int, list[torch.Tensor]] = {}


class DecodeMaskOffByOne(MultiHeadAttention):
    """Bug: a decoded token's mask row is the previous position's, so it cannot see itself."""

    def forward(self, x, use_cache=False):
        if use_cache and x.shape[1] == 1 and self.ptr_current_pos > 0:
            self.ptr_current_pos -= 1
            out = super().forward(x, use_cache=True)
            self.ptr_current_pos += 1
            return out
        return super().forward(x, use_cache)


class PointerNeverAdvances(MultiHeadAttention):
    """Bug: the position pointer is not advanced after a cached call (``self.ptr_current_pos += num_tokens`` left
    out), so every decoded token gets the mask row of position 0."""

    def forward(self, x, use_cache=False):
        out = super().forward(x, use_cache)
        if use_cache:
            self.ptr_current_pos -= x.shape[1]
        return out


class CacheInAGlobal(MultiHeadAttention):
    """Keeps its keys and values in a module-level dict: out of reach, so its state cannot be restored."""

    def forward(self, x, use_cache=False):
        if not use_cache:
            return super().forward(x)
        cache = _CACHES.setdefault(id(self), [])
        cache.append(x)
        return super().forward(torch.cat(cache, dim=1))[:, -x.shape[1]:]

    def reset_cache(self):
        _CACHES.pop(id(self), None)


class UseCacheWithoutReset(nn.Module):
    """``forward(x, use_cache=False)`` but no method to empty the cache."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.inner = MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias)

    def forward(self, x, use_cache=False):
        return self.inner(x, use_cache)


class KVGroupsAsGroupSize(nn.Module):
    """``num_kv_groups`` read as the number of query heads per key/value head: its k/v projections contradict
    the name (the layout shows ``num_heads // num_kv_groups`` kv heads)."""

    def __init__(self, d_in, d_out, num_heads, num_kv_groups, qkv_bias=False):
        super().__init__()
        head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, num_heads // num_kv_groups * head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_heads // num_kv_groups * head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        raise NotImplementedError("refused at load time")
