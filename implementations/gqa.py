"""Attention variants: grouped-query and multi-query attention, sliding windows, non-causal attention.

Every class takes the book's constructor plus ``num_kv_heads`` (``None`` = ``num_heads``), ``window``
(``None`` = full; ``w`` = the token and the previous ``w - 1``) and ``causal``, and keeps the book's
attribute names, so canonical weights load without an adapter (``W_key``/``W_value`` are
``nn.Linear(d_in, num_kv_heads * head_dim)``). Query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``: consecutive query heads share a kv head, which is what
``repeat_interleave`` along the head axis gives (``repeat`` would pair head ``h`` with kv head
``h % num_kv_heads``, a real bug; see ``tests/plugins/buggy_variants.py``).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

from attnbench.implementations._common import AttentionModule, add_book_projections, merge_heads, split_heads, visible
from attnbench.implementations.flex import _flex_available
from attnbench.plugins.catalog import register

warnings.filterwarnings("ignore", message=r"flex_attention called without torch.compile")

VARIANTS = dict(gqa=True, sliding_window=True, non_causal=True)
SDPA = "torch.nn.functional.scaled_dot_product_attention"


class VariantAttention(AttentionModule):
    """Book projections sized for ``num_kv_heads``; subclasses say how the heads attend."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)
        add_book_projections(self, d_in, d_out, qkv_bias, kv_dim=self.num_kv_heads * self.head_dim)
        self.dropout_p = dropout

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``(b, nh, T, hd)``, ``k``/``v`` ``(b, n_kv, T, hd)`` -> context ``(b, nh, T, hd)``."""
        raise NotImplementedError

    def project(self, x: torch.Tensor, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``(b, nh, T, hd)`` and ``k``/``v`` ``(b, n_kv, T, hd)`` of the tokens of ``x`` at positions
        ``start_pos ..`` (positions matter to subclasses with RoPE: ``implementations/rope.py``)."""
        q = split_heads(self.W_query(x), self.num_heads)  # (b, nh, T, hd)
        k = split_heads(self.W_key(x), self.num_kv_heads)  # (b, n_kv, T, hd)
        return q, k, split_heads(self.W_value(x), self.num_kv_heads)

    def forward(self, x):
        self.check_input(x)
        return self.out_proj(merge_heads(self.attend(*self.project(x))))  # (b, T, d_out)


class GroupedQueryAttention(VariantAttention):
    """The book's math (masked softmax, dropout) with K/V expanded to every query head by repeat_interleave."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dropout = nn.Dropout(self.dropout_p)

    def attend(self, q, k, v):
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=1)  # (b, nh, T, hd): kv head h // group for query head h
            v = v.repeat_interleave(self.group, dim=1)
        T = q.shape[-2]
        scores = q @ k.transpose(2, 3)  # (b, nh, T, T)
        allowed = visible(T, T, self.window, self.causal, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -torch.inf)
        weights = self.dropout(torch.softmax(scores / self.head_dim ** 0.5, dim=-1))
        return weights @ v  # (b, nh, T, hd)


class SDPAGQA(VariantAttention):
    """SDPA with enable_gqa=True: K/V stay at num_kv_heads; is_causal, or a bool mask for a window."""

    expand = False  # True: K/V expanded to num_heads before the call (works on any SDPA backend)
    always_mask = False  # True: the causal/window pattern always goes in as an explicit bool mask

    def attend(self, q, k, v):
        p = self.dropout_p if self.training else 0.0
        T = q.shape[-2]
        gqa = {}
        if self.group > 1 and self.expand:
            b, n_kv, _, hd = k.shape  # (b, n_kv, T, hd) -> (b, n_kv, group, T, hd) -> (b, nh, T, hd)
            k = k[:, :, None].expand(b, n_kv, self.group, T, hd).reshape(b, n_kv * self.group, T, hd)
            v = v[:, :, None].expand(b, n_kv, self.group, T, hd).reshape(b, n_kv * self.group, T, hd)
        elif self.group > 1:
            gqa = {"enable_gqa": True}
        if self.window is None and not self.always_mask:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal, **gqa)
        mask = visible(T, T, self.window, self.causal, q.device)  # True = may attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **gqa)  # (b, nh, T, hd)


class SDPAExpandedKV(SDPAGQA):
    """SDPA with K/V expanded to every query head (expand + reshape), as before enable_gqa existed."""

    expand = True


class SDPAWindowMask(SDPAGQA):
    """SDPA with an explicit sliding-window (and causal) bool mask, always: the custom-mask path."""

    always_mask = True


def _mask_mod(window: int | None, causal: bool):
    def mod(b, h, q_idx, kv_idx):
        ok = q_idx >= kv_idx if causal else q_idx == q_idx
        if window is not None:
            ok = ok & ((q_idx - kv_idx).abs() < window)
        return ok

    return mod


class FlexGQA(VariantAttention):
    """FlexAttention with enable_gqa=True and a causal and/or sliding-window block mask (cached per length)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._block_masks: dict = {}

    def _block_mask(self, T: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        if not self.causal and self.window is None:
            return None  # every pair is visible
        key = (T, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(_mask_mod(self.window, self.causal), None, None, T, T,
                                                       device=device)
        return self._block_masks[key]

    def attend(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        mask = self._block_mask(q.shape[-2], q.device)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=self.group > 1)  # (b, nh, T, hd)


def _factory(cls):
    def factory(spec):
        return cls(spec.d_in, spec.d_out, spec.context_length, spec.dropout, spec.num_heads, spec.qkv_bias,
                   spec.num_kv_heads, spec.window, spec.causal)

    factory.__name__ = f"{cls.__name__}_factory"
    factory.__doc__ = cls.__doc__
    return factory


register("gqa", _factory(GroupedQueryAttention), **VARIANTS,
         source="Raschka, LLMs from scratch, ch. 4 bonus (GQA: K/V repeat_interleave; sliding-window mask)")
register("sdpa_gqa", _factory(SDPAGQA), **VARIANTS, min_torch="2.5",
         source=f"{SDPA}(enable_gqa=True; is_causal, or a bool mask for windows)")
register("sdpa_expand_kv", _factory(SDPAExpandedKV), **VARIANTS,
         source=f"{SDPA} with K/V expanded to num_heads (expand + reshape)")
register("sdpa_window", _factory(SDPAWindowMask), **VARIANTS, min_torch="2.5",
         source=f"{SDPA}(attn_mask=sliding-window bool mask, enable_gqa=True)")
register("flex_gqa", _factory(FlexGQA), **VARIANTS, dropout=False, backward=("cuda",), min_torch="2.5",
         probe=_flex_available,
         source="torch.nn.attention.flex_attention(enable_gqa=True) with a causal/sliding-window block mask")
