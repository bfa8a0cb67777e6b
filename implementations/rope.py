"""The ``rope`` family: the attention layer of today's LLMs (Llama 3, Qwen3, Gemma, OLMo), issue 26.

Grouped-query attention with, as the spec asks (:class:`~attnbench.spec.AttnSpec`'s positional fields):
QK-norm (``nn.RMSNorm`` ``q_norm``/``k_norm`` over each head or the whole projection), rotary position
embeddings (tables of ``context_length`` rows built once from ``rope_theta`` and ``rope_scaling``, in the
``half`` or ``interleaved`` style) at absolute positions, a score scale and tanh soft-capping, and a KV cache
of rotated keys in the project's decode protocol (``forward(x, use_cache=True)``, ``reset_cache``,
``rewind_cache``; ``implementations/kv_cache.py``). ``forward(x, start_pos=p)`` runs a prefill whose tokens sit
at positions ``p ..``. Without positional fields set it is plain grouped-query attention.

* ``rope_sdpa``: ``F.scaled_dot_product_attention(scale=..., enable_gqa=True)`` (no soft-capping: SDPA has none);
* ``rope_math``: the book's explicit math with the scale and the cap (Gemma 2's ``attn_logit_softcapping``).

The cache is preallocated for ``context_length`` tokens; under a sliding window it is a ring of ``window`` slots (the
``kv_rolling`` storage of ``implementations/kv_cache.py``), so it holds what a later token can see, no more (issue 37).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from attnbench.correctness.rope import inv_freq
from attnbench.errors import InputShapeError, InvalidSpecError
from attnbench.implementations._common import merge_heads, split_heads
from attnbench.implementations.kv_cache import HOW, CachedAttention, PreallocatedCache, RollingCache
from attnbench.plugins.catalog import register
from attnbench.spec import AttnSpec
from attnbench.weights import BOOK_ADAPTER, Adapter, CanonicalWeights


def _to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    state = BOOK_ADAPTER.to_state(w, spec)
    if spec.qk_norm is not None:
        state.update({"q_norm.weight": w.g_q, "k_norm.weight": w.g_k})
    return state


def _from_state(s, spec: AttnSpec) -> CanonicalWeights:
    return replace(BOOK_ADAPTER.from_state(s, spec), g_q=s.get("q_norm.weight"), g_k=s.get("k_norm.weight"))


class RopeAttention(CachedAttention):
    """GQA with QK-norm -> RoPE at absolute positions -> scaled (capped) scores, and a cache of rotated keys (its
    storage from the subclass: preallocated, or a ring of window slots)."""

    weight_adapter = Adapter(_to_state, _from_state)

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, num_kv_heads=None,
                 window=None, causal=True, rope_theta=None, rope_style="half", rope_scaling=None, qk_norm=None,
                 norm_eps=1e-6, scale=None, softcap=None, rope_head_dim=None):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)
        self.spec = AttnSpec(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal,
                             rope_theta, rope_style, rope_scaling, qk_norm, norm_eps, scale, softcap,
                             rope_head_dim=rope_head_dim)
        self.rotated = rope_head_dim or self.head_dim  # partial rotary: the first rope_head_dim dims of each head
        if softcap is not None and self.use_sdpa:
            raise InvalidSpecError("scaled_dot_product_attention cannot soft-cap scores: use rope_math for softcap")
        width = {"head": (self.head_dim, self.head_dim), "full": (d_out, self.num_kv_heads * self.head_dim)}
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = (nn.RMSNorm(n, eps=norm_eps) for n in width[qk_norm])
        if rope_theta is not None:
            angles = torch.outer(torch.arange(context_length, dtype=torch.float64),
                                 inv_freq(self.rotated, rope_theta, rope_scaling))  # (context_length, rotated/2)
            self.register_buffer("rope_cos", angles.cos(), persistent=False)  # cast with the module's .to(dtype)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def rotate(self, t: torch.Tensor, start: int) -> torch.Tensor:
        """``t`` ``(b, h, T, hd)`` with each pair turned by its position's angles (positions ``start ..``)."""
        T = t.shape[-2]
        if self.rotated != t.shape[-1]:  # partial rotary: the rest of each head passes unrotated
            return torch.cat([self.rotate(t[..., :self.rotated], start), t[..., self.rotated:]], dim=-1)
        cos, sin = self.rope_cos[start:start + T].to(t.dtype), self.rope_sin[start:start + T].to(t.dtype)
        if self.spec.rope_style == "half":  # pair (j, j + hd/2)
            a, b = t.chunk(2, dim=-1)
        else:  # pair (2j, 2j + 1)
            a, b = t[..., 0::2], t[..., 1::2]
        turned_a, turned_b = a * cos - b * sin, a * sin + b * cos
        if self.spec.rope_style == "half":
            return torch.cat([turned_a, turned_b], dim=-1)
        return torch.stack([turned_a, turned_b], dim=-1).flatten(-2)

    def project(self, x, start_pos=0):
        q, k = self.W_query(x), self.W_key(x)  # (b, T, d_out), (b, T, kv_dim)
        if self.spec.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = split_heads(q, self.num_heads), split_heads(k, self.num_kv_heads)
        if self.spec.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.rope_theta is not None:
            q, k = self.rotate(q, start_pos), self.rotate(k, start_pos)
        return q, k, split_heads(self.W_value(x), self.num_kv_heads)

    def _attend(self, q, k, v, mask):
        scale = self.spec.score_scale
        if self.use_sdpa:
            p = self.dropout_p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale,
                                                  enable_gqa=self.group > 1)
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=1)  # (b, nh, L, hd): query head h reads kv head h // group
            v = v.repeat_interleave(self.group, dim=1)
        scores = (q @ k.transpose(2, 3)) * scale  # (b, nh, t, L)
        if self.spec.softcap is not None:
            scores = self.spec.softcap * torch.tanh(scores / self.spec.softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, -torch.inf)
        return self.dropout(torch.softmax(scores, dim=-1)) @ v  # (b, nh, t, hd)

    def forward(self, x, use_cache: bool = False, start_pos: int = 0):
        if use_cache:
            return super().forward(x, use_cache=True)
        self.check_input(x)
        if start_pos < 0 or start_pos + x.shape[1] > self.spec.context_length:
            raise InputShapeError(f"positions {start_pos}..{start_pos + x.shape[1] - 1} are outside the rotary tables "
                                  f"of context_length={self.spec.context_length}; pass a smaller start_pos")
        return self.out_proj(merge_heads(self.attend(*self.project(x, start_pos))))  # (b, T, d_out)


class RopeSDPA(RopeAttention, PreallocatedCache):
    """RoPE + QK-norm GQA attending with F.scaled_dot_product_attention(scale=..., enable_gqa=True)."""

    use_sdpa = True


class RopeMath(RopeAttention, PreallocatedCache):
    """RoPE + QK-norm GQA in the book's explicit math, with a score scale and tanh soft-capping."""


class RopeSDPAWindow(RopeAttention, RollingCache):
    """``RopeSDPA`` under a sliding window: its cache a ring of ``window`` slots of rotated keys."""

    use_sdpa = True


class RopeMathWindow(RopeAttention, RollingCache):
    """``RopeMath`` under a sliding window: its cache a ring of ``window`` slots of rotated keys."""


WINDOWED = {RopeSDPA: RopeSDPAWindow, RopeMath: RopeMathWindow}
"""The class each implementation builds under a sliding window (a cache trimmed to the window)."""


def _factory(cls):
    def factory(spec: AttnSpec) -> nn.Module:
        return (cls if spec.window is None else WINDOWED[cls])(**spec.kwargs())

    factory.__name__ = f"{cls.__name__}_factory"
    factory.__doc__ = cls.__doc__
    return factory


FAMILY = dict(gqa=True, sliding_window=True, non_causal=True, kv_cache=True, rope=True, qk_norm=True,
              score_scale=True, rope_partial=True)
LAYER = "RMSNorm QK-norm, rotary tables of context_length (Llama-3 scaling), a cache of rotated keys"
register("rope_sdpa", _factory(RopeSDPA), **FAMILY, min_torch="2.5",
         source=f"F.scaled_dot_product_attention(scale=, enable_gqa=True) after {LAYER}; {HOW}")
register("rope_math", _factory(RopeMath), **FAMILY, softcap=True,
         source=f"the book's masked-softmax math with a score scale and tanh soft-capping after {LAYER}; {HOW}")
