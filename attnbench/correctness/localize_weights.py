"""Scores applied to the values as they are: the softmax left out (issue 47).

``attn_weights = attn_weights.to(dtype)`` where ``F.softmax(attn_weights, dim=-1, ...).to(dtype)`` was: the tensor
multiplied into the values equals the masked scores, so every stage up to them matches and the first one found wrong
is the weighted values, at the product. The line that should have normalised them is the last one that made the
tensor the product takes (a cast or a move: where the softmax was), named as the probabilities; when the scores' own
computation made it (``scores = q @ k.T * scale`` then ``out = scores @ v``: the softmax line deleted between them),
the product is named, where unnormalised scores are first used as weights.
"""

from __future__ import annotations

from attnbench.correctness.localize_finding import LAYOUT_OPS, Evidence, Localization, named

SCORES = ("scores", "scaled scores", "capped scores", "masked scores")
"""Stages that are not yet weights: a product of one of them with the values has no softmax between."""
CASTS = frozenset({"Tensor.to", "Tensor.type", "Tensor.type_as", "Tensor.float", "Tensor.double", "Tensor.half",
                   "Tensor.bfloat16"})
"""Calls that only cast: where one makes the weights, the softmax was on its line."""


def unnormalised(div, ev: Evidence) -> Localization | None:
    """The line of the scores a product applies to the values without a softmax (see the module's doc), or None."""
    from attnbench.correctness.localize_roles import PRODUCTS

    if div.name not in ("probabilities", "probabilities @ V"):
        return None
    for rec in ev.records:
        if rec.op not in PRODUCTS or len([i for i in rec.args if i is not None]) < 2:
            continue
        weights, values = rec.args[0], rec.args[1]
        if weights is None or values is None or "v" not in ev.chains(values):
            continue
        held = [n for n in ev.explained.get(weights, ()) if n in SCORES]
        made = ev.records[weights]
        if held and (made.op in CASTS or made.op in LAYOUT_OPS):  # the line that should have normalised them
            words = (f"the {held[-1]} made here are applied to the values as they are (at {rec.where}): no softmax "
                     "normalises them into probabilities")
            return named("probabilities", made, words, ev.matched)
        if held:  # made by the scores' own computation: the softmax between them and the product is missing
            words = (f"the {held[-1]} made at {made.where} are applied to the values here as they are: no softmax "
                     "normalises them into probabilities")
            return named("probabilities", rec, words, ev.matched)
    return None
