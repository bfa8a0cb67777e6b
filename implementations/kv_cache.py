"""KV caches for token-by-token decoding, and the protocol ``attnbench run --mode decode`` relies on.

The protocol (in the style of the book's chapter-4 KV-cache bonus, ``use_cache`` / ``reset_cache``):

* ``forward(x)``: the ordinary full-sequence forward; it neither reads nor changes the cache.
* ``forward(x, use_cache=True)``: ``x`` ``(b, t, d_in)`` holds the *next* ``t`` tokens (positions
  ``n .. n + t - 1`` after ``n`` cached tokens). Their keys and values are added to the cache and
  their outputs ``(b, t, d_out)`` returned: a prefill is one call with the prompt, a decode step one
  call with a single token. Holding more than ``context_length`` tokens raises
  :class:`~attnbench.errors.InputShapeError`.
* ``reset_cache()``: forget every cached token (the next call starts at position 0).
* ``rewind_cache(n=1)``: forget the last ``n`` tokens, so the timer can decode the same position
  again and again with the cache length fixed (a rolling cache rewinds one token at a time).
* ``cache_tensors()``: the tensors holding keys and values; ``kv_cache_bytes`` is the size of their
  storage (what the cache really holds, including unused preallocated room).

An implementation declares ``kv_cache=True`` to be run in decode mode. The built-ins here are one of
each kind: a growing cache (``torch.cat``), a preallocated cache, SDPA over a preallocated cache, and a
rolling cache of ``window`` slots for sliding-window attention, whose memory and decode time stop
growing once the sequence is longer than the window (without a window it never wraps). All support grouped-query attention (the cache
holds ``num_kv_heads`` heads).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from attnbench.errors import InputShapeError, InvalidSpecError
from attnbench.implementations._common import merge_heads, visible
from attnbench.implementations.gqa import VariantAttention, _factory
from attnbench.plugins.catalog import register

PROTOCOL = ("reset_cache", "rewind_cache", "cache_tensors")
"""Methods an implementation with ``kv_cache=True`` must have (besides ``forward(x, use_cache=...)``)."""


class CachedAttention(VariantAttention):
    """Grouped-query attention with a KV cache; subclasses say how the cache is stored (:meth:`_update`)."""

    use_sdpa = False  # attend with F.scaled_dot_product_attention instead of the book's math

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dropout = nn.Dropout(self.dropout_p)
        self.cache_k = self.cache_v = None
        self.reset_cache()

    # -- the protocol -------------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Forget every cached token."""
        self.cache_k = self.cache_v = None
        self.pos = 0  # tokens seen since the last reset

    def rewind_cache(self, n: int = 1) -> None:
        """Forget the last ``n`` tokens."""
        self.pos -= n

    def cache_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the cached keys and values."""
        return [t for t in (self.cache_k, self.cache_v) if t is not None]

    # -- storage: subclasses ------------------------------------------------------------------------
    def _update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store ``k``/``v`` ``(b, n_kv, t, hd)`` of the tokens at ``self.pos ..``; return the keys and values
        to attend over and their positions (``None``: contiguous, ending with the new tokens)."""
        raise NotImplementedError

    def _after(self) -> None:
        """Called after attending (a growing cache trims itself to the window here)."""

    # -- attention ----------------------------------------------------------------------------------
    def attend(self, q, k, v):
        T = q.shape[-2]
        return self._attend(q, k, v, visible(T, T, self.window, self.causal, q.device))

    def _attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """``q`` ``(b, nh, t, hd)`` over ``k``/``v`` ``(b, n_kv, L, hd)``; ``mask`` ``(t, L)`` True = may attend."""
        if self.use_sdpa:
            p = self.dropout_p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=self.group > 1)
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=1)  # (b, nh, L, hd): query head h reads kv head h // group
            v = v.repeat_interleave(self.group, dim=1)
        scores = q @ k.transpose(2, 3)  # (b, nh, t, L)
        if mask is not None:
            scores = scores.masked_fill(~mask, -torch.inf)
        return self.dropout(torch.softmax(scores / self.head_dim ** 0.5, dim=-1)) @ v  # (b, nh, t, hd)

    def forward(self, x, use_cache: bool = False):
        if not use_cache:
            return super().forward(x)
        if not self.causal:
            raise InvalidSpecError("use_cache=True needs causal attention: build the layer with causal=True")
        b, t, width = x.shape
        if width != self.spec.d_in:
            raise InputShapeError(f"input width is {width} but the layer was built with d_in={self.spec.d_in}")
        if self.pos + t > self.spec.context_length:
            raise InputShapeError(f"the KV cache would hold {self.pos + t} tokens, more than context_length="
                                  f"{self.spec.context_length}; call reset_cache() or build the layer with a larger "
                                  "context_length")
        q, k, v = self.project(x, self.pos)  # (b, nh, t, hd), (b, n_kv, t, hd) x 2
        keys, values, key_pos = self._update(k, v)  # (b, n_kv, L, hd)
        if t == 1 and key_pos is None and self.window is None:
            mask = None  # one new token sees every cached one
        else:
            mask = visible(t, keys.shape[-2], self.window, True, q.device, key_pos=key_pos,
                           q_start=None if key_pos is None else self.pos)
        self.pos += t
        context = self._attend(q, keys, values, mask)
        self._after()
        return self.out_proj(merge_heads(context))  # (b, t, d_out)


class GrowingCache(CachedAttention):
    """The book's chapter-4 cache: torch.cat of each new token's K/V (trimmed to the window, if any)."""

    def _update(self, k, v):
        if self.cache_k is None or self.pos == 0:
            self.cache_k, self.cache_v = k, v
        else:
            self.cache_k = torch.cat([self.cache_k, k], dim=2)  # (b, n_kv, L + t, hd)
            self.cache_v = torch.cat([self.cache_v, v], dim=2)
        return self.cache_k, self.cache_v, None

    def _after(self):
        if self.window is not None and self.cache_k.shape[2] > self.window:  # keep only what a later token can see
            self.cache_k = self.cache_k[:, :, -self.window:].clone()
            self.cache_v = self.cache_v[:, :, -self.window:].clone()

    def rewind_cache(self, n: int = 1) -> None:
        super().rewind_cache(n)
        self.cache_k, self.cache_v = self.cache_k[:, :, :-n], self.cache_v[:, :, :-n]


class PreallocatedCache(CachedAttention):
    """K/V buffers for the whole context_length, allocated once per batch size; a pointer marks the end."""

    def _update(self, k, v):
        b, n_kv, t, hd = k.shape
        if self.cache_k is None or self.cache_k.shape[0] != b or self.cache_k.dtype != k.dtype or self.cache_k.device != k.device:
            shape = (b, n_kv, self.spec.context_length, hd)
            self.cache_k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.cache_v = torch.zeros(shape, dtype=v.dtype, device=v.device)
        end = self.pos + t
        self.cache_k[:, :, self.pos:end] = k
        self.cache_v[:, :, self.pos:end] = v
        return self.cache_k[:, :, :end], self.cache_v[:, :, :end], None

    def reset_cache(self) -> None:  # the buffers stay allocated; entries past the pointer are never read
        self.pos = 0


class SDPACache(PreallocatedCache):
    """F.scaled_dot_product_attention(enable_gqa=True) over a preallocated K/V cache."""

    use_sdpa = True


class RollingCache(CachedAttention):
    """A ring of min(window, context_length) K/V slots: token p lives in slot p % window, overwriting p - window.

    Without a window it has context_length slots and never wraps (a preallocated cache)."""

    def reset_cache(self) -> None:
        self.cache_k = self.cache_v = None
        self.slot_pos = None  # (slots,) position held by each slot, -1 = empty
        self.pos = 0

    def _update(self, k, v):
        b, n_kv, t, hd = k.shape
        slots = min(self.window or self.spec.context_length, self.spec.context_length)
        if self.cache_k is None:
            self.cache_k = torch.zeros((b, n_kv, slots, hd), dtype=k.dtype, device=k.device)
            self.cache_v = torch.zeros((b, n_kv, slots, hd), dtype=v.dtype, device=v.device)
            self.slot_pos = torch.full((slots,), -1, dtype=torch.long, device=k.device)
        if t == 1:  # the slot's old token (pos - window) is outside the new token's window: overwrite first
            slot = self.pos % slots
            self.cache_k[:, :, slot] = k[:, :, 0]
            self.cache_v[:, :, slot] = v[:, :, 0]
            self.slot_pos[slot] = self.pos
            return self.cache_k, self.cache_v, self.slot_pos
        new_pos = torch.arange(self.pos, self.pos + t, device=k.device)
        keys = torch.cat([self.cache_k, k], dim=2)  # (b, n_kv, slots + t, hd): earlier prompt tokens need old slots
        values = torch.cat([self.cache_v, v], dim=2)
        key_pos = torch.cat([self.slot_pos, new_pos])
        keep = min(t, slots)
        idx = new_pos[-keep:] % slots
        self.cache_k[:, :, idx] = k[:, :, -keep:]
        self.cache_v[:, :, idx] = v[:, :, -keep:]
        self.slot_pos[idx] = new_pos[-keep:]
        return keys, values, key_pos

    def rewind_cache(self, n: int = 1) -> None:
        if n != 1:
            raise ValueError("a rolling cache rewinds one token at a time (older slots were overwritten)")
        super().rewind_cache(1)
        slot = self.pos % self.cache_k.shape[2]
        self.slot_pos[slot] = -1  # held the token just forgotten; its overwritten predecessor is out of window


CACHES = dict(gqa=True, non_causal=True, kv_cache=True)
HOW = "KV-cache protocol: forward(x, use_cache=True), reset_cache, rewind_cache (see implementations/kv_cache.py)"
register("kv_concat", _factory(GrowingCache), **CACHES, sliding_window=True,
         source=f"Raschka, LLMs from scratch, ch. 4 KV-cache bonus (torch.cat cache); {HOW}")
register("kv_prealloc", _factory(PreallocatedCache), **CACHES,
         source=f"preallocated K/V buffers of context_length with a position pointer; {HOW}")
register("sdpa_cache", _factory(SDPACache), **CACHES, min_torch="2.5",
         source=f"torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) over a preallocated cache; {HOW}")
register("kv_rolling", _factory(RollingCache), **CACHES, sliding_window=True,
         source=f"a ring buffer of window slots (sliding-window attention, e.g. Mistral); {HOW}")
