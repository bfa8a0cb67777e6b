"""Queries and keys turned opposite ways by RoPE (issue 47).

The RoPE direction probe (:mod:`attnbench.plugins.measured`) reads a class's direction off one score, and the
reference then turns its pairs the class's way (``rope_sign=-1``: nanochat's -theta, the same function up to
reflecting q and k). A class that turns its queries by -theta and its keys by +theta (Llama's complex tables with a
``conj()`` on the queries only) has no direction: the probe reports one side's, the reference follows it, and the
side that is right is blamed. When the rotated queries match one direction and the rotated keys only the other, the
divergence is located against the reference's default (+theta): the side that turns the other way is named.
"""

from __future__ import annotations

from collections.abc import Callable

from attnbench.correctness.localize_finding import Localization
from attnbench.correctness.localize_match import matches
from attnbench.correctness.localize_record import Record
from attnbench.correctness.stages import Stage


def opposite_turns(records: list[Record], stages: list[Stage], plus: list[Stage] | None,
                   tol: float) -> Callable[[Localization], Localization] | None:
    """When q and k turn opposite ways (``stages`` at the measured -theta, ``plus`` at +theta), a function that adds
    that to the line found against ``plus``; ``None`` otherwise."""
    if plus is None:
        return None
    measured, _ = matches(records, stages, tol)
    default, _ = matches(records, plus, tol)
    sides = {s: (f"rotated {s}" in measured, f"rotated {s}" in default) for s in ("q", "k")}
    for wrong, right in (("q", "k"), ("k", "q")):
        if sides[wrong] == (True, False) and sides[right] == (False, True):
            note = (f" ({wrong} turns its pairs by -theta and {right} by +theta: opposite directions, and +theta, the "
                    f"default, names {wrong}; the direction measured, -theta, was {wrong}'s)")
            return lambda found: _noted(found, note)
    return None


def _noted(found: Localization, note: str) -> Localization:
    """``found`` with ``note`` after its detail."""
    if found.detail is None:
        return found
    found.line = found.line.replace(f": {found.detail}", f": {found.detail}{note}", 1)
    found.detail += note
    return found
