"""The float64 reference of DeepSeek-style multi-head latent attention (issue 46), in its naive form.

DeepSeek-V2/V3 (and Kimi K2) compress keys and values into one latent per token and give every head a rotary key it
shares with the others (:class:`~attnbench.spec.AttnSpec`'s MLA fields; canonical weights:
:func:`attnbench.weights.mla_shapes`). Written as plainly as :mod:`attnbench.correctness.reference`: the latents and
the shared rotary key computed once, then one explicit loop over heads that materialises each head's keys and values
from the latent by slicing the canonical ``W_k`` (= W_UK) and ``W_v`` (= W_UV) by rows. For token ``t`` at position
``p``:

* query: ``q = W_q c_q`` with ``c_q = RMSNorm(W_dq x)`` (gain ``g_dq``; ``q_lora_rank``) or ``c_q = x`` (full rank);
  head ``h`` is ``[q_nope_h | q_pe_h]``, ``qk_nope_head_dim`` then ``qk_rope_head_dim`` wide;
* kv: ``[c_kv_raw | k_pe] = W_dkv x``; ``c_kv = RMSNorm(c_kv_raw)`` (gain ``g_dkv``); ``k_pe`` is ONE key per token;
* ``q_pe_h`` and ``k_pe`` rotated at ``p`` (RoPE of width ``qk_rope_head_dim``, ``spec.rope_style`` pairs);
* head ``h``: score ``(q_nope_h . W_UK_h c_kv + q_pe_h . k_pe) * score_scale``, softmax over the allowed keys
  (:func:`attnbench.correctness.reference.head_probs`: the same masks and score modifiers as every spec), value
  ``W_UV_h c_kv``; the heads' values concatenated and projected by ``W_o`` (plus ``b_o``).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from attnbench.correctness.probs import head_probs
from attnbench.correctness.rope import apply_rope, rms_norm, rope_tables
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights


def mla_latents(x: torch.Tensor, w: CanonicalWeights, spec: AttnSpec, start_pos: int = 0,
                lowp: frozenset[str] = frozenset()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, c_kv, k_pe)`` of ``x`` ``(b, T, d_in)`` at positions ``start_pos ..``: the queries ``(b, T, heads,
    qk_head_dim)`` with their rope slice rotated, the normed kv latent ``(b, T, kv_lora_rank)`` and the rotated
    shared key ``(b, T, qk_rope_head_dim)``."""
    norm_dtype = torch.float32 if "norm" in lowp else None
    nope, r = spec.qk_nope_head_dim, spec.kv_lora_rank
    c_q = x if w.W_dq is None else rms_norm(F.linear(x, w.W_dq), w.g_dq, spec.norm_eps, norm_dtype)  # (b, T, q_lora)
    q = F.linear(c_q, w.W_q).unflatten(-1, (spec.num_heads, spec.qk_head_dim))  # (b, T, heads, nope + rope)
    kv = F.linear(x, w.W_dkv)  # (b, T, kv_lora_rank + rope): [latent | shared rotary key]
    c_kv = rms_norm(kv[..., :r], w.g_dkv, spec.norm_eps, norm_dtype)  # (b, T, kv_lora_rank)
    positions = range(start_pos, start_pos + x.shape[1])
    cos, sin = rope_tables(positions, spec.qk_rope_head_dim, spec.rope_theta, spec.rope_scaling, spec.rope_style,
                           dtype=x.dtype, compute_dtype=torch.float32 if "rope" in lowp else torch.float64)
    sin = sin * spec.rope_sign
    q_pe = apply_rope(q[..., nope:].transpose(1, 2), cos, sin, spec.rope_style).transpose(1, 2)  # (b, T, heads, rope)
    k_pe = apply_rope(kv[..., r:], cos, sin, spec.rope_style)  # (b, T, rope): rotated once, for every head
    return torch.cat([q[..., :nope], q_pe], dim=-1), c_kv, k_pe


def mla_forward(x: torch.Tensor, w: CanonicalWeights, spec: AttnSpec, allowed: torch.Tensor,
                alibi: torch.Tensor | None = None, start_pos: int = 0,
                lowp: frozenset[str] = frozenset()) -> torch.Tensor:
    """DeepSeek MLA of ``x`` ``(b, T, d_in)`` -> ``(b, T, d_out)`` in the dtype of its inputs, keys and values
    materialised per head (the module docstring); ``allowed`` ``(T, T)`` is the mask, ``alibi`` the bias per head
    (:func:`attnbench.correctness.reference.reference_forward` builds both)."""
    nope, vd = spec.qk_nope_head_dim, spec.v_head_dim
    q, c_kv, k_pe = mla_latents(x, w, spec, start_pos, lowp)  # (b, T, heads, qk), (b, T, r), (b, T, rope)
    heads = []
    for h in range(spec.num_heads):
        k_nope = F.linear(c_kv, w.W_k[h * nope:(h + 1) * nope])  # (b, T, nope): W_UK_h c_kv
        v = F.linear(c_kv, w.W_v[h * vd:(h + 1) * vd])  # (b, T, v_head_dim): W_UV_h c_kv
        scores = (torch.einsum("bid,bjd->bij", q[:, :, h, :nope], k_nope)
                  + torch.einsum("bid,bjd->bij", q[:, :, h, nope:], k_pe)) * spec.score_scale  # (b, T, T)
        heads.append(head_probs(scores, h, w, spec, allowed, alibi, lowp) @ v)  # (b, T, v_head_dim)
    context = torch.cat(heads, dim=-1)  # (b, T, heads * v_head_dim), head h in columns h*vd:(h+1)*vd
    return F.linear(context, w.W_o, w.b_o)
