"""Which key/value head each query head reads, measured on the class, never assumed (issue 46).

The reference's grouped-query attention lets consecutive query heads share a kv head: query head ``h`` reads kv head
``h // g`` (``repeat_interleave``, ``g = num_heads // num_kv_heads``). A class that expands its keys and values with
einops' ``repeat(k, 'b kvh n d -> b (r kvh) n d')`` (lucidrains' x-transformers) lets query head ``h`` read kv head
``h % num_kv_heads`` instead ("strided"). Neither is a bug: it is an order of the query heads, so the layout holds
canonical head ``(h % kv)·g + h // kv`` in the class's head ``h`` (its rows of ``W_q`` and ``b_q``, its columns of
``W_o``), and a class that reads any other head fails its GQA cases.

The probe: weights chosen so that every query scores every key alike (``W_q = W_k = 0``), kv head ``j``'s values are
all ``j + 1`` (a token whose first feature is 1) and ``W_o = I``: the class's output in head ``h``'s columns is the
number of the kv head it read, plus one. The keys are probed too, one kv head at a time (only its keys are not zero, so
only the query heads that read it weigh the tokens unevenly): a class whose keys and values are read in different
orders is not reordered, because no order of its query heads makes it right.
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
    it reads ``h % num_kv_heads``; ``""`` too when the probe shows neither (the GQA cases show what it does), and when
    its keys and its values are read in different orders (``repeat`` on one, ``repeat_interleave`` on the other: a
    bug no order of the query heads hides, so its GQA cases fail and localisation names the line).
    ``run(state, x)`` loads ``state`` (``to_state(w, spec)``) into a class built at ``spec`` and returns its output."""
    heads, kv = spec.num_heads, spec.num_kv_heads or spec.num_heads
    g = heads // kv
    values = _value_reads(run, to_state, spec)
    if values != [h % kv for h in range(heads)] or values == [h // g for h in range(heads)]:
        return ""
    keys = _key_reads(run, to_state, spec)
    return "" if keys is not None and keys != values else STRIDED


def _probe_weights(spec: AttnSpec) -> CanonicalWeights:
    """Weights with zero biases, ``W_o = I`` and no sink, for the order probes to fill in."""
    w = random_weights(spec)
    zero = {n: torch.zeros_like(t) for n, t in (("b_q", w.b_q), ("b_k", w.b_k), ("b_v", w.b_v)) if t is not None}
    return replace(w, W_q=torch.zeros_like(w.W_q), W_k=torch.zeros_like(w.W_k), W_v=torch.zeros_like(w.W_v),
                   b_o=torch.zeros_like(w.b_o), W_o=torch.eye(spec.d_out, dtype=w.W_o.dtype),
                   sinks=None if w.sinks is None else w.sinks - 1e4, **zero)


def _reads(run, to_state, spec: AttnSpec, w: CanonicalWeights, x: torch.Tensor) -> list[float] | None:
    """What each query head's first output feature holds for the last token; None when the class does not run."""
    try:
        with torch.no_grad():
            out = run(to_state(w, spec), x)
        out = out[0] if isinstance(out, tuple) else out
        return [float(out[0, -1, h * spec.head_dim]) for h in range(spec.num_heads)]
    except Exception:  # does not run at the probe's sizes: nothing measured
        return None


def _value_reads(run, to_state, spec: AttnSpec) -> list[int] | None:
    """The kv head whose values each query head reads: every query scores every key alike (``W_q = W_k = 0``) and
    kv head ``j``'s values are all ``j + 1``."""
    kv, hd = spec.num_kv_heads or spec.num_heads, spec.head_dim
    w = _probe_weights(spec)
    for j in range(kv):
        w.W_v[j * hd:(j + 1) * hd, 0] = j + 1
    x = torch.zeros(1, 3, spec.d_in)
    x[..., 0] = 1.0
    got = _reads(run, to_state, spec, w, x)
    return None if got is None else [round(v) - 1 for v in got]


def _key_reads(run, to_state, spec: AttnSpec) -> list[int] | None:
    """The kv head whose keys each query head reads, or None when the probe cannot tell: token ``t`` has value ``t``,
    the queries are random, and only kv head ``j``'s keys are (random): the query heads that read it weigh the three
    tokens unevenly, the rest read keys of zero and average them (exactly 1). Norms and rotations keep a zero key
    zero, so a QK-norm or RoPE does not blur it."""
    heads, kv, hd = spec.num_heads, spec.num_kv_heads or spec.num_heads, spec.head_dim
    if spec.d_in < 2:
        return None
    g = torch.Generator().manual_seed(46)
    x = torch.zeros(1, 3, spec.d_in)
    x[..., 0], x[0, :, 1] = 1.0, torch.arange(3.0)
    reads: list[int | None] = [None] * heads
    for j in range(kv):
        w = _probe_weights(spec)
        w.W_q.copy_(torch.randn(w.W_q.shape, generator=g))
        w.W_v[0::hd, 1] = 1.0
        w.W_k[j * hd:(j + 1) * hd] = 3.0 * torch.randn(hd, w.W_k.shape[1], generator=g)
        got = _reads(run, to_state, spec, w, x)
        if got is None:
            return None
        for h, v in enumerate(got):
            if abs(v - 1) > 1e-3:
                if reads[h] is not None:
                    return None
                reads[h] = j
    return None if None in reads else reads
