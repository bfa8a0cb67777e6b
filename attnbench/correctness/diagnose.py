"""Likely causes of a failed forward, verified against the reference, never guessed.

When a module's output differs from the reference, a few simple mistakes explain most failures of hand-written
attention: the scores scaled by ``1/sqrt(d_model)`` (or not at all) instead of ``1/sqrt(head_dim)``, no causal mask,
weights used untransposed, queries and keys swapped. For each, the reference is computed *with that mistake*; a
cause is named only when the module's output matches that altered reference within the case's tolerance (times
:data:`MATCH_FACTOR`), so every "likely cause" line is a fact about the run: the module computes exactly that.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

MATCH_FACTOR = 10.0
"""An altered reference explains a failure when the output is within this many tolerances of it."""


def _scale_candidates(spec) -> list[tuple[str, float]]:
    """``(words, scale)`` for the score scales a mistake gives (never the spec's own)."""
    hd = spec.head_dim
    named = [("d_out", spec.d_out), ("d_in", spec.d_in), ("num_heads", spec.num_heads)]
    out, seen = [], {round(spec.score_scale, 12)}
    for what, n in named:
        s = 1 / math.sqrt(n)
        if round(s, 12) not in seen:
            seen.add(round(s, 12))
            want = "1/sqrt(head_dim)" if spec.scale is None else f"{spec.score_scale:g}"
            here = f"1/sqrt({n}) vs 1/sqrt({hd})" if spec.scale is None else f"1/sqrt({n}) vs {spec.score_scale:g}"
            out.append((f"scores scaled by 1/sqrt({what}), expected {want} (here {here})", s))
    for words, s in (("scores not scaled (a factor 1)", 1.0), (f"scores scaled by 1/head_dim = 1/{hd}, not its square "
                                                              "root", 1 / hd)):
        if round(s, 12) not in seen:
            seen.add(round(s, 12))
            out.append((words, s))
    return out


def _alternatives(spec, w):
    """``(cause, spec, weights)`` for each mistake that applies to ``spec``."""
    for words, s in _scale_candidates(spec):
        yield words, replace(spec, scale=s), w
    if spec.causal:
        yield "no causal mask: each token also attends to later tokens", replace(spec, causal=False, window=None,
                                                                                 prefix=None), w
    yield from _mask_alternatives(spec, w)
    if spec.d_in == spec.d_out and spec.kv_dim == spec.d_out:
        t = replace(w, W_q=w.W_q.T, W_k=w.W_k.T, W_v=w.W_v.T, W_o=w.W_o.T)
        yield "weights used untransposed (x @ W instead of x @ W.T, as nn.Linear stores them)", spec, t
    if spec.kv_dim == spec.d_out:
        swapped = replace(w, W_q=w.W_k, W_k=w.W_q, b_q=w.b_k, b_k=w.b_q, g_q=w.g_k, g_k=w.g_q)
        yield "queries and keys swapped (scores k.q^T: each key attends over the queries)", spec, swapped


def _mask_alternatives(spec, w):
    """The masks of issue 37 (:mod:`attnbench.correctness.masks`) left out, one at a time."""
    if spec.prefix is not None:
        yield "the prefix attended causally, not both ways (prefix-LM)", replace(spec, prefix=None), w
    if spec.alibi:
        yield "no ALiBi bias", replace(spec, alibi=False), w
    if spec.documents:
        yield "no document mask: tokens attend across document starts", replace(spec, documents=None), w
    if spec.sinks:
        yield "the sink logits left out of the softmax's denominator", replace(spec, sinks=False), replace(w, sinks=None)


def likely_cause(reference, built, x_low: torch.Tensor, out: torch.Tensor, tol: float) -> str | None:
    """The verified cause of a failed forward (``out`` for input ``x_low``), or ``None``; ``reference(x, w, spec)``
    is the matrix's reference function and ``built`` the :class:`~attnbench.correctness.cases.Built` under test."""
    from attnbench.correctness.cases import rel_error

    x64 = x_low.detach().cpu().to(torch.float64)
    w64 = built.weights.to(dtype=torch.float64)
    limit = max(MATCH_FACTOR * tol, 1e-6 if x_low.dtype == torch.float64 else 1e-4)
    for cause, spec, w in _alternatives(built.spec, w64):
        try:
            err = rel_error(out, reference(x64, w, spec))
        except Exception:  # an alteration the reference cannot compute for this spec: no evidence either way
            continue
        if err <= limit:
            return f"{cause}; the output matches the reference computed that way (error {err:.1g})"
    return None
