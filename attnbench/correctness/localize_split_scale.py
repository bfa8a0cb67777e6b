"""A score scale split between the queries and the keys, one half left out (issue 47).

Whisper's ``qkv_attention`` scales q and k each by ``head_dim ** -0.25``, so the scores get ``head_dim ** -0.5``.
With the keys' half left out, the queries are off from the reference's scaled q by exactly the half they carry: that
q line is right, and the line that made the keys the scores read is where the other half is missing.
:func:`split_scale` names that line when the queries' factor over the scaled q is the inverse root of the score
scale (so q holds its square root: half of a split scale) and the scores read keys that match the reference's.
"""

from __future__ import annotations

import math

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_scale import EXACT, score_scale


def split_scale(div, ev: Evidence) -> Localization | None:
    """At ``scaled q`` off by the inverse root of the score scale: the keys' line the scores read (see the module's
    doc); ``None`` otherwise."""
    scale, factor = score_scale(ev), div.fit.factor
    if div.name != "scaled q" or not scale or not math.isfinite(factor) or div.fit.fit > ev.tol:
        return None
    if abs(factor * factor * scale - 1) > 1e3 * EXACT:
        return None
    for rec in ev.records:
        others = [i for i in rec.args if i is not None and i != div.rec.index]
        if div.rec.index not in rec.args or len(others) != 1:
            continue
        keys = ev.records[others[0]]
        if "k" not in ev.chains(keys.index):
            continue
        half = math.sqrt(scale)
        words = (f"the score scale {scale:g} is split between q and k ({half:g} each, as the queries here carry): the "
                 f"keys reach the scores without their half")
        return named("scaled scores", keys, words, ev.matched)
    return None
