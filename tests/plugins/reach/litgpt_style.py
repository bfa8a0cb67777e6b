"""litgpt's conventions: ``CausalSelfAttention(config: Config, block_idx)`` with its own dataclass (``n_query_groups`` =
key/value heads, ``head_size``, ``rotary_percentage`` 0.25 by default, ``bias`` on by default, a sliding window applied
by the class itself when ``sliding_window_size`` is set), one fused ``qkv`` and ``proj``, cos/sin as 3-D
``(1, T, rope_n_elem)`` tables, and ``input_pos`` that, when given, means "use the KV cache"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class Config:
    block_size: int = 4096
    n_layer: int = 16
    n_embd: int = 4096
    n_head: int = 32
    head_size: int | None = None
    n_query_groups: int | None = None
    rotary_percentage: float = 0.25
    bias: bool = True
    sliding_window_size: int | None = None
    sliding_window_indices: list | None = None

    def __post_init__(self):
        self.head_size = self.head_size or self.n_embd // self.n_head
        self.n_query_groups = self.n_query_groups or self.n_head
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)
        if self.sliding_window_size is not None and self.sliding_window_indices is None:
            self.sliding_window_indices = [1] * self.n_layer


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.dim() != 3:
        raise ValueError(f"cos must be three-dimensional, but shape is {cos.shape}")
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, block_idx: int) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size,
                             bias=config.bias)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=config.bias)
        self.kv_cache = None
        windows = config.sliding_window_indices
        self.apply_sliding_window = bool(config.sliding_window_size is not None and windows and windows[block_idx])

    def heads(self, x, cos, sin):
        """q, k, v ``(B, heads, T, head_size)``, q and k rotated on their first ``rope_n_elem`` dimensions."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split((c.n_head * c.head_size, c.n_query_groups * c.head_size,
                                     c.n_query_groups * c.head_size), dim=-1)
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        n = c.rope_n_elem
        q = torch.cat((rotate_half(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((rotate_half(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        return q, k, v

    def forward(self, x, cos, sin, mask=None, input_pos=None):
        if input_pos is not None and self.kv_cache is None:
            raise TypeError("You need to build the KV cache first")
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.heads(x, cos, sin)
        k = k.repeat_interleave(c.n_head // c.n_query_groups, dim=1)
        v = v.repeat_interleave(c.n_head // c.n_query_groups, dim=1)
        if self.apply_sliding_window:  # the class's own window, causal, replaces the mask
            i = torch.arange(T)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < c.sliding_window_size)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size))


class KVCache(nn.Module):
    """litgpt's cache convention: preallocated ``(B, n_query_groups, max_seq_length, head_size)`` buffers; calling it
    with ``(input_pos, k, v)`` writes the step's keys and values at the positions ``input_pos`` (a tensor) and returns
    the whole buffers."""

    def __init__(self, k_shape, v_shape, device=None, dtype=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape, device=device, dtype=dtype), persistent=False)

    def forward(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k[: k.size(0)].index_copy_(2, input_pos, k)
        self.v[: v.size(0)].index_copy_(2, input_pos, v)
        return self.k[: k.size(0)], self.v[: v.size(0)]


class CachedCausalSelfAttention(CausalSelfAttention):
    """The same layer decoding as litgpt does: its model calls ``attn.kv_cache = attn.build_kv_cache(...)`` and passes
    ``input_pos`` (positions, a tensor) and ``input_pos_maxp1`` (where the filled part ends); the forward refuses a
    cache that is not its own ``KVCache``."""

    def build_kv_cache(self, batch_size: int, max_seq_length: int, rope_cache_length: int | None = None,
                       device=None, dtype=None) -> KVCache:
        c = self.config
        shape = (batch_size, c.n_query_groups, max_seq_length, c.head_size)
        return KVCache(shape, shape, device=device, dtype=dtype)

    def forward(self, x, cos, sin, mask=None, input_pos=None, input_pos_maxp1=None):
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.heads(x, cos, sin)
        if input_pos is not None:
            if not isinstance(self.kv_cache, KVCache):
                raise TypeError("You need to call `gpt.set_kv_cache()`")
            k, v = self.kv_cache(input_pos, k, v)
            if input_pos_maxp1 is not None:
                k, v = k[..., :input_pos_maxp1, :], v[..., :input_pos_maxp1, :]
        k = k.repeat_interleave(c.n_head // c.n_query_groups, dim=1)
        v = v.repeat_interleave(c.n_head // c.n_query_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size))
