"""Which key/value head each query head reads, measured on the class, never assumed (issue 46).

The reference's grouped-query attention lets consecutive query heads share a kv head: query head ``h`` reads kv head
``h // g`` (``repeat_interleave``, ``g = num_heads // num_kv_heads``). A class that expands its keys and values with
einops' ``repeat(k, 'b kvh n d -> b (r kvh) n d')`` (lucidrains' x-transformers) lets query head ``h`` read kv head
``h % num_kv_heads`` instead ("strided"). Neither is a bug: it is an order of the query heads, so the layout holds
canonical head ``(h % kv)·g + h // kv`` in the class's head ``h`` (its rows of ``W_q`` and ``b_q``, its columns of
``W_o``), and a class that reads any other head fails its GQA cases.

The probe: weights chosen so that every query scores every key alike (``W_q = W_k = 0``), kv head ``j``'s values are
all ``j + 1`` (a token whose first feature is 1) and ``W_o = I``: the class's output in head ``h``'s columns is the
number of the kv head it read, plus one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights, random_weights

STRIDED = "strided"


def order(spec: AttnSpec, groups: str, inverse: bool = False) -> list[int] | None:
    """The canonical head the class's head ``h`` holds, for each ``h`` (its inverse with ``inverse``); None when the
    class reads as the reference does (or the spec has one kv head per query head, or one for all)."""
    heads, kv = spec.num_heads, spec.num_kv_heads or spec.num_heads
    if groups != STRIDED or kv in (1, heads):
        return None
    g = heads // kv
    held = [(h % kv) * g + h // kv for h in range(heads)]
    return [held.index(c) for c in range(heads)] if inverse else held


def reorder(w: CanonicalWeights, spec: AttnSpec, groups: str, inverse: bool = False) -> CanonicalWeights:
    """``w`` with its query heads in the class's order (``W_q``/``b_q`` rows, ``W_o`` columns, per-projection q gains,
    sink logits); back to the canonical order with ``inverse``."""
    idx = order(spec, groups, inverse)
    if idx is None:
        return w
    heads, hd = spec.num_heads, spec.head_dim

    def rows(t):
        return t if t is None or t.shape[0] != heads * hd else t.reshape(heads, hd, *t.shape[1:])[idx].reshape(t.shape)

    w_o = w.W_o.reshape(w.W_o.shape[0], heads, hd)[:, idx].reshape(w.W_o.shape)
    sinks = None if w.sinks is None else w.sinks[idx]
    return replace(w, W_q=rows(w.W_q), b_q=rows(w.b_q), W_o=w_o, g_q=rows(w.g_q), sinks=sinks)


def measure(run, to_state, spec: AttnSpec) -> str:
    """``""`` when the class's query head ``h`` reads kv head ``h // g`` (the reference's order), :data:`STRIDED` when
    it reads ``h % num_kv_heads``; ``""`` too when the probe shows neither (the GQA cases show what it does).
    ``run(state, x)`` loads ``state`` (``to_state(w, spec)``) into a class built at ``spec`` and returns its output."""
    heads, kv, hd = spec.num_heads, spec.num_kv_heads or spec.num_heads, spec.head_dim
    w = random_weights(spec)
    w_v = torch.zeros_like(w.W_v)
    for j in range(kv):
        w_v[j * hd:(j + 1) * hd, 0] = j + 1
    zero = {n: torch.zeros_like(t) for n, t in (("b_q", w.b_q), ("b_k", w.b_k), ("b_v", w.b_v)) if t is not None}
    w = replace(w, W_q=torch.zeros_like(w.W_q), W_k=torch.zeros_like(w.W_k), W_v=w_v, b_o=torch.zeros_like(w.b_o),
                W_o=torch.eye(spec.d_out, dtype=w.W_o.dtype), sinks=None if w.sinks is None else w.sinks - 1e4, **zero)
    x = torch.zeros(1, 3, spec.d_in)
    x[..., 0] = 1.0
    try:
        with torch.no_grad():
            out = run(to_state(w, spec), x)
        out = out[0] if isinstance(out, tuple) else out
        reads = [round(float(out[0, -1, h * hd])) - 1 for h in range(heads)]
    except Exception:  # does not run at the probe's sizes: nothing measured
        return ""
    g = heads // kv
    return STRIDED if reads == [h % kv for h in range(heads)] and reads != [h // g for h in range(heads)] else ""
