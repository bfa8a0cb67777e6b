"""The float64 reference every implementation is compared against.

Written as plainly as possible (one explicit loop over heads, slicing the canonical matrices by rows)
so that it shares no reshape, transpose or mask convention with the implementations under test.
It implements every variant of :class:`~attnbench.spec.AttnSpec`: grouped-query and multi-query
attention (query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``), sliding windows and
non-causal attention, and the positional fields (issue 26): QK-norm, RoPE at absolute positions (of the whole
head, or of its first ``rope_head_dim`` dimensions), a score scale and soft-capping
(:mod:`attnbench.correctness.rope` holds the small functions). DeepSeek-style MLA (issue 46) has a reference of its
own, :mod:`attnbench.correctness.mla_reference`, which shares this module's masks and softmax.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from attnbench.correctness import masks
from attnbench.correctness.probs import head_probs  # noqa: F401  (re-exported: the reference's public name)
from attnbench.correctness.rope import apply_rope_part, rms_norm, rope_tables, rotate
from attnbench.correctness.stages import note
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights


def allowed_pairs(T_q: int, T_k: int, window: int | None = None, causal: bool = True, offset: int = 0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """``(T_q, T_k)`` bool, True where query ``i`` (at position ``offset + i``) may attend to key ``j``.

    Causal: ``j <= i``; a window ``w`` keeps ``i - j < w`` (causal) or ``|i - j| < w`` (non-causal).
    """
    i = torch.arange(T_q, device=device)[:, None] + offset  # (T_q, 1) query positions
    j = torch.arange(T_k, device=device)[None, :]  # (1, T_k) key positions
    ok = (j <= i) if causal else torch.ones(T_q, T_k, dtype=torch.bool, device=device)
    if window is not None:
        ok = ok & ((i - j).abs() < window)
    return ok


def reference_forward(x: torch.Tensor, w: CanonicalWeights, num_heads: int, *, window: int | None = None,
                      causal: bool = True, spec: AttnSpec | None = None, start_pos: int = 0,
                      lowp: frozenset[str] = frozenset()) -> torch.Tensor:
    """Multi-head attention of ``x`` ``(b, T, d_in)`` with canonical weights ``w``; returns ``(b, T, d_out)``.

    The number of kv heads is read from ``w.W_k``'s rows (``num_kv_heads * head_dim``). Computed in the
    dtype of its inputs (pass float64 for the reference); no dropout. With ``spec``, its positional fields
    apply in this order: QK-norm (gains ``w.g_q``, ``w.g_k``) -> RoPE at the absolute positions
    ``start_pos + i`` -> scores * ``spec.score_scale`` -> soft-capping -> mask -> softmax.

    Masks and score modifiers (issue 37, :mod:`attnbench.correctness.masks`) of ``spec``: ALiBi's ``-slope_h * |i - j|`` is
    added after the soft-cap, a prefix and documents join the mask, and the sink logit ``w.sinks[h]`` joins each
    softmax's denominator (as one more score whose probability multiplies no value).

    ``lowp`` names the parts computed in float32 whatever the inputs' dtype (``norm``, ``rope``, ``softmax``), as
    many real classes do (:mod:`attnbench.correctness.precision`): the error of that math is the floor a class
    working in float32 there is judged against.
    """
    b, T, _ = x.shape
    allowed = allowed_pairs(T, T, window, causal, device=x.device)
    if spec is not None and (spec.prefix is not None or spec.documents):
        pos = torch.arange(start_pos, start_pos + T, device=x.device)
        allowed = masks.keep(pos[:, None], pos[None, :], causal=causal, window=window, prefix=spec.prefix,
                             documents=spec.documents)
    alibi = masks.alibi_bias(num_heads, T, device=x.device, dtype=x.dtype) if spec is not None and spec.alibi else None
    if getattr(spec, "is_mla", False):  # issue 46: DeepSeek-style MLA (it imports this module: imported here)
        from attnbench.correctness.mla_reference import mla_forward

        return mla_forward(x, w, spec, allowed, alibi, start_pos, lowp)
    hd = w.W_q.shape[0] // num_heads
    group = num_heads // (w.W_k.shape[0] // hd)  # query heads per kv head
    q, k = _queries_keys(x, w, hd, spec, start_pos, lowp)  # (b, T, heads, hd) each, normed and rotated
    v = F.linear(x, w.W_v, w.b_v)
    note("v", v)  # issue 47: the named stages (nothing is kept outside attnbench.correctness.stages.capture)
    v = v.unflatten(-1, (-1, hd))
    scale = spec.score_scale if spec is not None else 1 / math.sqrt(hd)
    heads = []
    for h in range(num_heads):
        kv = h // group
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, kv])  # (b, T, T)
        note("scores", scores, h)
        scores = scores * scale
        note("scaled scores", scores, h)
        probs = head_probs(scores, h, w, spec, allowed, alibi, lowp)
        note("probabilities", probs, h)
        heads.append(probs @ v[:, :, kv])  # (b, T, hd)
        note("probabilities @ V", heads[-1], h)
    context = torch.cat(heads, dim=-1)  # (b, T, d_out), head h in columns h*hd:(h+1)*hd
    note("merged heads", context)
    out = F.linear(context, w.W_o, w.b_o)
    note("output", out)
    return out


def _queries_keys(x: torch.Tensor, w: CanonicalWeights, hd: int, spec: AttnSpec | None,
                  start_pos: int, lowp: frozenset[str] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``(b, T, heads, hd)``: projected, QK-normed, rotated at ``start_pos + i`` as ``spec`` says."""
    q, k = F.linear(x, w.W_q, w.b_q), F.linear(x, w.W_k, w.b_k)  # (b, T, d_out), (b, T, kv_dim)
    note("q", q), note("k", k)
    norm = spec.qk_norm if spec is not None else None
    if norm is not None and (w.g_q is None or w.g_k is None):
        raise ValueError(f"spec.qk_norm={norm!r} needs canonical gains g_q and g_k (random_weights draws them)")
    norm_dtype = torch.float32 if "norm" in lowp else None
    if norm == "full":
        q, k = rms_norm(q, w.g_q, spec.norm_eps, norm_dtype), rms_norm(k, w.g_k, spec.norm_eps, norm_dtype)
    q, k = q.unflatten(-1, (-1, hd)), k.unflatten(-1, (-1, hd))
    if norm == "head":
        q, k = rms_norm(q, w.g_q, spec.norm_eps, norm_dtype), rms_norm(k, w.g_k, spec.norm_eps, norm_dtype)
    if norm is not None:
        note("normed q", q), note("normed k", k)
    if spec is not None and spec.rope_theta is not None:
        positions = range(start_pos, start_pos + x.shape[1])
        r = getattr(spec, "rope_head_dim", None) or hd  # issue 46: the first r dims of each head (partial rotary)
        cos, sin = rope_tables(positions, r, spec.rope_theta, spec.rope_scaling, spec.rope_style, dtype=x.dtype,
                               compute_dtype=torch.float32 if "rope" in lowp else torch.float64)
        sin = sin * getattr(spec, "rope_sign", 1)  # -1: pairs turn by -theta (nanochat), a convention, not a bug
        if r == hd and getattr(spec, "rope_sign", 1) == 1:  # issue 47: the terms of x cos + rotate(x) sin
            for name, t in (("q", q), ("k", k)):
                note(f"{name} * cos", t * cos.to(t.dtype)[:, None]), note(f"rotate({name})", rotate(t, spec.rope_style))
        q = apply_rope_part(q.transpose(1, 2), cos, sin, spec.rope_style).transpose(1, 2)
        k = apply_rope_part(k.transpose(1, 2), cos, sin, spec.rope_style).transpose(1, 2)
        note("rotated q", q), note("rotated k", k)
    return q, k
