"""nanochat's attention conventions in full, written for attnbench's tests: ``(config, layer_idx)``, ``GPTConfig``,
``c_q``/``c_k``/``c_v``/``c_proj``, ``forward(x, ve, cos_sin, window_size, kv_cache)``, rotary tables as one
``cos_sin`` tuple of ``(1, T, 1, head_dim/2)`` tensors applied as a turn by **-theta**, a QK-norm **without weights**
followed by a constant factor on q and k, a flash-attention style ``(left, right)`` window, and a KV-cache *object*
(``get_layer_cache(layer_idx)``, ``cache_seqlens``, ``n_layers``, ``advance``) that the caller passes in and that the
last layer advances. ``(B, T, H, D)`` layout throughout. The planted variants at the end are bugs the checks must flag.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from attnbench import CacheObject

FACTOR = 1.2


@dataclass
class GPTConfig:
    sequence_len: int = 1024
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 256


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, direction: float = -1.0) -> torch.Tensor:
    """Pairs (j, j + D/2) turned by direction * angle (-1: the transpose of the textbook's turn)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    s = sin * direction
    return torch.cat([a * cos - b * s, a * s + b * cos], dim=-1)


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def attend(q, k, v, window_size, offset: int):
    """q (B, Tq, H, D) at positions offset.., k/v (B, Tk, Hkv, D) from position 0; (left, right) window, causal."""
    tq, tk = q.shape[1], k.shape[1]
    i = torch.arange(tq, device=q.device)[:, None] + offset
    j = torch.arange(tk, device=q.device)[None, :]
    keep = j <= i
    if window_size[0] >= 0:
        keep = keep & (i - j <= window_size[0])
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                       enable_gqa=q.shape[2] != k.shape[2])
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.n_embd = config.n_head, config.n_kv_head, config.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.c_q = nn.Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, bias=False)

    def queries_keys(self, x, cos_sin, cached: bool):
        B, T, _ = x.shape
        cos, sin = cos_sin
        q = turn(self.c_q(x).view(B, T, self.n_head, self.head_dim), cos, sin)
        k = turn(self.c_k(x).view(B, T, self.n_kv_head, self.head_dim), cos, sin)
        return unit_rms(q) * FACTOR, unit_rms(k) * FACTOR

    def forward(self, x, ve, cos_sin, window_size, kv_cache):
        B, T, _ = x.shape
        q, k = self.queries_keys(x, cos_sin, kv_cache is not None)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            v = v + ve.view_as(v)
        if kv_cache is None:
            y = attend(q, k, v, window_size, 0)
        else:
            keys, values = kv_cache.get_layer_cache(self.layer_idx)
            pos = int(kv_cache.cache_seqlens[0])
            keys[:, pos:pos + T], values[:, pos:pos + T] = k, v
            y = attend(q, keys[:, :pos + T], values[:, :pos + T], window_size, pos)
            if self.layer_idx == kv_cache.n_layers - 1:
                kv_cache.advance(T)
        return self.c_proj(y.reshape(B, T, self.n_embd))


class OtherFactor(CausalSelfAttention):
    """Not a bug: queries leave the norm at 1.5 (= 1.2 * 1.25), keys at 1.2: scores sharper by 1.8 = 1.3416^2 (the
    measurement reads it; the reference follows)."""

    def queries_keys(self, x, cos_sin, cached: bool):
        q, k = super().queries_keys(x, cos_sin, cached)
        return q * 1.25, k


class FactorLostWhenCached(CausalSelfAttention):
    """Bug: the factor is applied without a cache but forgotten on the cached (decoding) path."""

    def queries_keys(self, x, cos_sin, cached: bool):
        q, k = super().queries_keys(x, cos_sin, cached)
        return (q / FACTOR, k / FACTOR) if cached else (q, k)


class KeysTurnTheOtherWay(CausalSelfAttention):
    """Bug: queries turned by -theta, keys by +theta (no convention: the two disagree)."""

    def queries_keys(self, x, cos_sin, cached: bool):
        B, T, _ = x.shape
        cos, sin = cos_sin
        q = turn(self.c_q(x).view(B, T, self.n_head, self.head_dim), cos, sin, -1.0)
        k = turn(self.c_k(x).view(B, T, self.n_kv_head, self.head_dim), cos, sin, 1.0)
        return unit_rms(q) * FACTOR, unit_rms(k) * FACTOR


class NormAcrossHeads(CausalSelfAttention):
    """Bug: the parameterless norm taken across the heads (dim 2) instead of within each head."""

    def queries_keys(self, x, cos_sin, cached: bool):
        B, T, _ = x.shape
        cos, sin = cos_sin
        q = turn(self.c_q(x).view(B, T, self.n_head, self.head_dim), cos, sin)
        k = turn(self.c_k(x).view(B, T, self.n_kv_head, self.head_dim), cos, sin)

        def across(t):
            return t * torch.rsqrt(t.pow(2).mean(2, keepdim=True) + 1e-6)

        return across(q) * FACTOR, across(k) * FACTOR


class Store:
    """A cache object with an API of its own: ``append(k, v)`` returns everything so far; the caller advances."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def append(self, k, v):
        k = k if self.k is None else torch.cat([self.k[:, :self.length], k], 1)
        v = v if self.v is None else torch.cat([self.v[:, :self.length], v], 1)
        self.k, self.v = k, v
        return k, v


def _make_store(spec, batch, device, dtype):
    return Store()


def _advance(store, n):
    store.length += n


class DeclaredCacheAttention(CausalSelfAttention):
    """Its own cache object, declared through attnbench's protocol (the model advances it after each step)."""

    attnbench_cache_object = CacheObject(make=_make_store, advance=_advance)

    def forward(self, x, ve, cos_sin, window_size, kv_cache):
        B, T, _ = x.shape
        q, k = self.queries_keys(x, cos_sin, kv_cache is not None)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        offset = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        return self.c_proj(attend(q, k, v, window_size, offset).reshape(B, T, self.n_embd))
