"""A score scale applied in the wrong place (issue 47).

``softmax(scores) / sqrt(d)`` masks and normalises the scores unscaled: the first tensor where scaled scores were
expected is the unscaled one (at the mask line, off by exactly ``1/scale``). That line is right for what it was given;
the bug is where the scale went. When a later tensor of the class is one of its own inputs times exactly the score
scale, the scale was applied there, and that line is named, at the stage where the scale was missed.
"""

from __future__ import annotations

import math

import torch

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_match import compare
from attnbench.correctness.localize_record import Record

SLOT = ("scaled scores", "masked scores")
"""The stages at which scores missing their scale are first seen."""

EXACT = 1e-6
"""How close (relative) a factor must be to the score scale to be it."""


def score_scale(ev: Evidence) -> float | None:
    """The reference's score scale: its scaled scores over its scores (``None`` when it has neither)."""
    raw, scaled = ev.stage("scores"), ev.stage("scaled scores")
    if raw is None or scaled is None:
        return None
    factor = compare(scaled.tensor, raw.tensor).factor
    return factor if math.isfinite(factor) and factor > 0 else None


def moved_scale(div, ev: Evidence) -> Localization | None:
    """The line that applies the score scale to a later tensor, when ``div`` is the scores without their scale (see
    the module's doc); ``None`` otherwise, or when no later tensor takes the scale."""
    scale = score_scale(ev)
    if div.name not in SLOT or scale is None or abs(scale - 1) <= EXACT:
        return None
    if not (div.exact and div.fit.fit <= ev.tol and abs(div.fit.factor * scale - 1) <= EXACT):
        return None
    later = ev.descendants(div.rec.index)
    for rec in ev.records[div.rec.index + 1:]:
        if rec.index in ev.explained or rec.index not in later:
            continue
        if _scales(rec, ev, scale):
            words = (f"the score scale {scale:.3g} is applied here, to a later tensor: the scores reach "
                     f"{div.rec.where} without it (off by a factor of {div.fit.factor:.3g})")
            return named(div.name, rec, words, ev.matched)
    return None


def _scales(rec: Record, ev: Evidence, scale: float) -> bool:
    """Whether ``rec`` is its one input on the forward's values times ``scale`` (where both are finite)."""
    if len(rec.args) != 1 or rec.args[0] is None:
        return False
    before = ev.records[rec.args[0]].value
    if before.shape != rec.value.shape:
        return False
    got, was = rec.value.to(torch.float64), before.to(torch.float64)
    keep = torch.isfinite(got) & torch.isfinite(was) & (was != 0)
    if not keep.any():
        return False
    fit = compare(got[keep], was[keep] * scale)
    return fit.error <= max(ev.tol, EXACT)
