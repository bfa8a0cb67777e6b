"""A forward that raises in one dtype only (issue 47): the line of the class's torch call that raised.

``masked_fill(mask, -1e9)`` raises in float16 (``value cannot be converted to type at::Half without overflow``):
every float16 case is an error and its values never reach the output. The replay in the case's dtype raises at the
same call; the recorder keeps where (:class:`~attnbench.correctness.localize_record.Failure`), and the stage named is
the one the call computes (by its name: a mask fill, a softmax) or else the first stage nothing recorded before it
matches. An exception raised by the class's own ``raise`` (not a torch call) names no line.
"""

from __future__ import annotations

from attnbench.correctness.localize_finding import CHAIN, Localization, named
from attnbench.correctness.localize_match import matches
from attnbench.correctness.stages import ORDER

STAGE_OF = {"masked_fill": "masked scores", "masked_fill_": "masked scores", "where": "masked scores",
            "softmax": "probabilities", "log_softmax": "probabilities", "exp": "probabilities",
            "scaled_dot_product_attention": "probabilities @ V"}
"""The stage a torch call computes, by the call's name (``Tensor.`` dropped)."""


def raised(rp, dtype: str, tol: float) -> Localization | None:
    """The line of the class's torch call that raised in replay ``rp`` (in ``dtype``), or ``None`` when what raised
    was not a torch call of the class's code."""
    fail = rp.failure
    if fail is None or not rp.stages:
        return None
    before = rp.records[:fail.after]
    matched, _ = matches(before, rp.stages, tol)
    present = [s.name for s in rp.stages if s.name in ORDER]
    stage = STAGE_OF.get(fail.op.removeprefix("Tensor."))
    if stage not in present:
        done = [ORDER.index(n) for n in matched if n not in CHAIN]
        stage = next((n for n in present if n not in matched and (n not in CHAIN or not done)
                      and ORDER.index(n) > max(done, default=-1)), "output")
    message = str(fail.error).splitlines()[0] if str(fail.error) else ""
    words = f"raises {type(fail.error).__name__} in {dtype}: {message}"
    return named(stage, fail, words, {n: r for n, r in matched.items() if ORDER.index(n) < ORDER.index(stage)})
