"""A mask computed and then not used (issue 47).

``attn_scores.masked_fill(mask, -inf)`` without the trailing underscore returns a new tensor, which the class drops:
the scores it goes on with are unmasked. The first divergence is that dropped tensor (it is masked but not scaled,
or scaled but not where the reference masks), and rules for scales then name the scores' line; but what is wrong is
that the masking line's result is never used. A masking call whose result no later step of the output descends from
is named as such, when the output descends from the scores it masks (the class went on with those); when it
descends from neither, the way back is what is lost (blocks written into a preallocated output), and nothing is said.
"""

from __future__ import annotations

from attnbench.correctness.localize_finding import Evidence, Localization, named

MASKING = frozenset({"Tensor.masked_fill", "masked_fill", "where", "Tensor.where"})


def unused_mask(div, ev: Evidence) -> Localization | None:
    """The masking line whose result the class drops, when the first divergence is it; else None."""
    rec = div.rec
    if rec.op not in MASKING or not ev.records:
        return None
    out = ev.records[-1]
    used = ev.ancestors(out.index)
    if rec.index == out.index or rec.index in used:
        return None
    if not any(i in used for i in rec.args if i is not None):
        return None  # nor the scores it masks: the output is not followed back to them (a write into a buffer)
    hint = " (Tensor.masked_fill returns a new tensor; masked_fill_ masks in place)" if "masked_fill" in rec.op else ""
    return named("masked scores", rec, f"the masked scores made here are never used: nothing the output is computed "
                                       f"from descends from them{hint}, so the scores the class goes on with are "
                                       "unmasked", ev.matched)
