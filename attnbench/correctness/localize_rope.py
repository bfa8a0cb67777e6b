"""Queries and keys turned opposite ways by RoPE (issue 47).

The RoPE direction probe (:mod:`attnbench.plugins.measured`) reads a class's direction off one score, and the
reference then turns its pairs the class's way (``rope_sign=-1``: nanochat's -theta, the same function up to
reflecting q and k). A class that turns its queries by -theta and its keys by +theta (Llama's complex tables with a
``conj()`` on the queries only) has no direction: the probe reports one side's, the reference follows it, and the
side that is right is blamed. When the rotated queries match one direction and the rotated keys only the other, the
divergence is located against the reference's default (+theta): the side that turns the other way is named.

The same holds for the pairs: when the form a case checks is not the class's (a class that pairs halves declared for
every form, or a bug on one side that misleads a probe), neither side matches and the right side is blamed, although
a bug on one side (a sign flipped in the keys' line of a helper shared by both) is what made it fail. When the
divergence is at a rotated stage where neither side matches and, in another form (pairs half or interleaved, +theta
or -theta), one rotated side matches and the other does not, the divergence is located in that form
(:func:`other_form`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from attnbench.correctness.localize_finding import LAYOUT_OPS, Localization
from attnbench.correctness.localize_match import matches
from attnbench.correctness.localize_names import bound_name
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


ROTATED = ("rotated q", "rotated k")


def other_form(records: list[Record], found: Localization, measured: list[Stage],
               conventions: list[tuple[str, list[Stage]]], tol: float,
               locate: Callable[[list[Stage]], Localization]) -> Localization | None:
    """``found`` (at a rotated stage of ``measured``, the stages in the RoPE form the probes read, where neither
    rotated side matches) located again in the first other form of ``conventions`` in which exactly one rotated side
    matches, noted; ``None`` when there is none."""
    if found.stage not in ROTATED or any(name in matches(records, measured, tol)[0] for name in ROTATED):
        return None  # one side matches the form the probes read: that form stands
    for form, stages in conventions:
        got, _ = matches(records, stages, tol)
        if sum(name in got for name in ROTATED) != 1:
            continue
        again = locate(stages)
        if again.stage in ROTATED and again.stage != found.stage:
            right = next(name for name in ROTATED if name in got)
            return _noted(again, f" (in {form}, not the form this case checks, {right} matches the reference and "
                                 f"only this side differs)")
    return None


def _other_side_rotated(div, ev):
    """``(side, other, record)`` when ``div`` is at one side's rotated stage and the other side's rotated stage matched
    in a helper (its record), else None."""
    if div.name not in ROTATED:
        return None
    side, other = div.name[-1], "k" if div.name[-1] == "q" else "q"
    rotated = ev.matched.get(f"rotated {other}")
    if rotated is None or rotated.func is None or rotated.caller is None:
        return None
    return side, other, rotated


def unrotated(div, ev) -> Localization | None:
    """A side that leaves the rotation unrotated (``xk_out = view_as_real(xk_)``, the product with the table left
    out): when ``div`` is at one rotated stage and the other side's rotated stage matched in a helper, the last line
    of that helper (not its ``return``) whose tensor still equals this side's unrotated heads is named."""
    from attnbench.correctness.localize_finding import named

    found = _other_side_rotated(div, ev)
    if found is None:
        return None
    side, other, rotated = found
    same = [r for r in ev.records if r.func == rotated.func and not r.text.startswith("return")
            and {f"{side} heads", f"normed {side}"} & set(ev.explained.get(r.index, ()))]
    if not same:
        return None
    from_side = ev.descendants(same[0].index)
    last = max((r for r in ev.records if r.func == rotated.func and r.index in from_side), key=lambda r: r.index)
    if not {f"{side} heads", f"normed {side}"} & set(ev.explained.get(last.index, ())):
        return None  # what the helper gives for this side is turned, only wrongly: not left unrotated
    rec = same[-1]
    words = (f"{side} leaves the rotation here as it came in: it equals the {side} heads, not the rotated {side} "
             f"(the {other} side is rotated at {rotated.where})")
    return named(div.name, rec, words, ev.matched)


def never_rotated(div, ev) -> Localization | None:
    """One side never rotated at all (its rotation line deleted): when ``div`` is at that side's rotated stage, the
    other side's rotated stage matched, and the scores take this side's heads as they came, the line that rotates the
    other side is named: this side's rotation belongs beside it."""
    from attnbench.correctness.localize_finding import named
    from attnbench.correctness.localize_roles import PRODUCTS

    side = {"rotated q": "q", "rotated k": "k"}.get(div.name)
    other = {"q": "k", "k": "q"}.get(side)
    rotated = ev.matched.get(f"rotated {other}") if side else None
    if rotated is None:
        return None
    plain = {i for i, names in ev.explained.items() if {f"{side} heads", f"normed {side}"} & set(names)}
    for r in ev.records:  # and what only moves them (GQA's repeat_interleave of the keys before SDPA)
        if r.op in LAYOUT_OPS and r.args and all(i in plain for i in r.args if i is not None):
            plain.add(r.index)
    scoring = [r for r in ev.records if r.op in PRODUCTS or r.op.endswith("scaled_dot_product_attention")]
    if not any(plain & set(r.args) and rotated.index in ev.ancestors(r.index) for r in scoring):
        return None
    words = (f"the {other} side is rotated here, the {side} side never is: the scores take {side} as it came (its "
             f"rotation belongs beside this line)")
    # in a helper whose call is not given this side (``q, v = rotary(q, v)``), its call is the line; else its own
    call = rotated.caller is not None and not _passes(rotated.caller, [ev.records[i] for i in sorted(plain)], ev)
    return named(div.name, rotated, words, ev.matched, call_site=call)


def _passes(caller: tuple, plain: list[Record], ev) -> bool:
    """Does the call line ``caller`` read a name one of the records ``plain`` was assigned to (``xk`` in ``xq, xk =
    self.rotate(xq, xk, ...)``, by :func:`~attnbench.correctness.localize_names.bound_name`)? True when no such
    name is known (nothing to go on: the helper's line stays)."""
    names = {bound_name(rec, ev.records)[0] for rec in plain} - {None}
    return not names or any(re.search(rf"\b{re.escape(n)}\b", caller[2]) for n in names)


def paths_differ(div, ev) -> Localization | None:
    """Where one side's steps in a shared rotary helper first differ from the other's (its pairs formed another way:
    ``reshape(..., 2, -1)`` for q, ``reshape(..., -1, 2)`` for k), when ``div`` is at one rotated stage and the
    other side's rotated stage matched in that helper: the first step whose call or shape differs, on this side."""
    from attnbench.correctness.localize_finding import named

    found = _other_side_rotated(div, ev)
    if found is None:
        return None
    side, other, rotated = found
    mine, theirs = _path(ev, rotated.func, side), _path(ev, rotated.func, other)
    for a, b in zip(mine, theirs, strict=False):
        if a.op != b.op or a.value.shape[-2:] != b.value.shape[-2:]:
            words = (f"{side}'s steps differ here from {other}'s at {b.where} ({a.op} giving {tuple(a.value.shape)}, "
                     f"where {other} gets {b.op} giving {tuple(b.value.shape)}); {other} is rotated right")
            return named(div.name, a, words, ev.matched)
    return None


def _path(ev, func, side: str) -> list:
    """The records of ``func`` computed from this side's heads, in order (empty when it does not take them)."""
    start = next((r for r in ev.records if r.func == func
                  and {f"{side} heads", f"normed {side}"} & {n for i in r.inputs for n in ev.explained.get(i, ())}),
                 None)
    if start is None:
        return []
    reached = ev.descendants(start.index)
    return [r for r in ev.records if r.func == func and r.index in reached]


def discarded(div, ev) -> Localization | None:
    """A rotated side that was computed and then not used (``xq, _ = apply_rotary_emb(xq, xk, ...)``: the scores take
    the keys unrotated): when the divergence is at the scores or later and does not descend from a rotated stage
    that matched, the line that made it is named (the helper's call, when it is in a helper)."""
    from attnbench.correctness.localize_finding import named

    if div.name in ROTATED or div.name not in ("scores", "scaled scores", "capped scores", "masked scores"):
        return None
    used = ev.ancestors(div.rec.index)
    for side in ("q", "k"):
        rec = ev.matched.get(f"rotated {side}")
        if rec is None or rec.index in used or any(r.index in used for r in ev.records
                                                   if f"rotated {side}" in ev.explained.get(r.index, ())):
            continue
        at = replace(rec, path=rec.caller[0], line=rec.caller[1], text=rec.caller[2], caller=None) \
            if rec.caller is not None else rec
        return named(f"rotated {side}", at, f"the rotated {side} made here ({rec.where}) is not used: the scores at "
                                            f"{div.rec.where} take {side} unrotated", ev.matched)
    return None
