"""A fused attention call given the wrong ``scale=`` (issue 47).

``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / self.head_dim)`` (the square root left out) is
one op: its queries, keys and values match the reference's, and its output does not, with no intermediate between
them to say why. Whether the scale is what differs is measured: the call is recomputed, causal, on the class's own
q, k and v at the scale that fits its output best (a bounded search over the scale's logarithm). When that output is
the class's and the scale is not the reference's, the line of the call that says ``scale=`` (a call spanning several
lines names that line) is named, with both scales; the call's first line when it passes none.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import torch
import torch.nn.functional as F

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_record import argument_line
from attnbench.correctness.localize_scale import score_scale

SCALE_ARG = re.compile(r"\bscale\s*=")


def sdpa_scale(div, ev: Evidence) -> Localization | None:
    """The ``scale=`` line of a fused attention call whose output is the reference's at another scale; else None."""
    rec, ref = div.rec, score_scale(ev)
    if "scaled_dot_product_attention" not in rec.op or len(rec.args) < 3 or None in rec.args[:3] or ref is None:
        return None
    if [ev.chains(i) for i in rec.args[:3]] != [{"q"}, {"k"}, {"v"}]:
        return None  # its inputs must be the reference's q, k and v heads: only the call itself then differs
    q, k, v = (ev.records[i].value.double() for i in rec.args[:3])
    if not (q.shape == k.shape == v.shape == rec.value.shape):
        return None
    scale, error = _best_scale(q, k, v, rec.value.double(), ref)
    if error > max(ev.tol, 1e-6) or abs(scale / ref - 1) <= 1e-3:  # q, k, v exact: 1e-6 is the call alone
        return None
    line, text = argument_line(rec.path, rec.line, SCALE_ARG) or (rec.line, rec.text)
    at = replace(rec, line=line, text=text)
    words = (f"scaled_dot_product_attention at {rec.where} scales the scores by {scale:.4g}, where the reference's "
             f"scale is {ref:.4g} (1/sqrt(head_dim)): at that scale its output is the class's (error {error:.1e})")
    return named(div.name, at, words, ev.matched)


def _best_scale(q, k, v, out, ref: float) -> tuple[float, float]:
    """The scale (within 100x of ``ref``) at which causal attention of ``q, k, v`` is closest to ``out``, and the
    relative error there."""
    from scipy.optimize import minimize_scalar

    size = float(out.abs().max().clamp_min(1e-12))

    def error(log_scale: float) -> float:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=math.exp(log_scale))
        return float((y - out).abs().max()) / size

    with torch.no_grad():
        found = minimize_scalar(error, bounds=(math.log(ref / 100), math.log(ref * 100)), method="bounded",
                                options={"xatol": 1e-10})
        return math.exp(found.x), error(found.x)
