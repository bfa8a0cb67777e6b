"""The one part of a joined stage that is wrong (issue 47, round 19).

A rotation written out in halves (``xq_out_r = xq_r * cos - xq_i * sin``, ``xq_out_i = xq_r * sin + xq_i * cos``,
then ``torch.stack([xq_out_r, xq_out_i], -1).flatten(3)``) makes the rotated queries from parts computed on lines of
their own. No part is in any stage's form, so a divergence there was named at the first line the whole was computed
from: the first half, right, when the second was wrong. :func:`wrong_part` takes the ``stack``/``cat`` that stands for
the stage (directly, or under the ``flatten``/``view``/``reshape`` that makes it), cuts the reference's stage the same
way, in each layout the joined tensor could have, and, in the layout where some parts match and some do not, names
the line of the first that does not.
"""

from __future__ import annotations

import torch

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_layout import GATHERS
from attnbench.correctness.localize_match import best_fit, compare, layouts

RESHAPES = frozenset({"Tensor.flatten", "flatten", "torch.flatten", "Tensor.view", "Tensor.reshape", "reshape",
                      "torch.reshape"})
STACKS = frozenset({"stack", "torch.stack"})


def _join(rec, ev: Evidence):
    """The join record standing for ``rec`` (itself, or what a reshape of it was made from), or None."""
    if rec is None:
        return None
    if rec.op in RESHAPES and len(rec.args) >= 1 and rec.args[0] is not None:
        inner = ev.records[rec.args[0]]
        rec = inner if inner.op in GATHERS else rec
    ok = rec.op in GATHERS and 2 <= len(rec.args) <= 4 and None not in rec.args
    return rec if ok else None


def _cut(whole: torch.Tensor, join, parts: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``whole`` (the joined tensor's shape) cut into tensors shaped like ``parts`` as ``join`` joined them."""
    if join.op in STACKS:
        axes = [a for a in range(join.value.dim()) if join.value.shape[a] == len(parts)
                and join.value.shape[:a] + join.value.shape[a + 1:] == parts[0].shape]
        return None if not axes else list(whole.reshape(join.value.shape).unbind(axes[-1]))
    for axis in range(join.value.dim()):
        sizes = [p.shape[axis] for p in parts if p.dim() == join.value.dim()]
        if len(sizes) == len(parts) and sum(sizes) == join.value.shape[axis]:
            return list(whole.reshape(join.value.shape).split(sizes, dim=axis))
    return None


def wrong_part(div, ev: Evidence) -> Localization | None:
    """The line of the one part of the joined tensor standing for ``div``'s stage that differs from the reference's
    same part, while another part matches."""
    for rec in (div.seen, div.rec):
        join = _join(rec, ev)
        if join is None:
            continue
        parts = [ev.records[i].value for i in join.args]
        if len({p.shape for p in parts}) != 1 and join.op in STACKS:
            continue
        found = next((f for name in dict.fromkeys((div.name, *ROTATED)) if (stage := ev.stage(name)) is not None
                      and (f := _part_off(stage, rec, join, parts, ev) or _stacked_swap(stage, rec, join, parts, ev))
                      is not None), None)
        if found is not None:
            return found
    return None


ROTATED = ("rotated q", "rotated k", "q heads", "k heads")
"""Stages a joined tensor may stand for when the one ``div`` names is later (SDPA fuses the scores: a wrong rotated
key is first seen in the probabilities applied to V); the heads themselves when the case has no RoPE (a class given
neutral tables rotates by nothing)."""


def _part_off(stage, rec, join, parts: list[torch.Tensor], ev: Evidence) -> Localization | None:
    """The first part of ``join`` that differs from ``stage`` cut alike, in a layout where another part matches."""
    if stage.tensor.numel() != rec.value.numel():
        return None
    for arranged in layouts(stage, tuple(rec.value.shape), strict=False):
        cut = _cut(arranged, join, parts)
        if cut is None or any(c.shape != p.shape for c, p in zip(cut, parts, strict=True)):
            continue
        errors = [compare(p, c.to(p.dtype)).error for p, c in zip(parts, cut, strict=True)]
        wrong = [i for i, e in enumerate(errors) if e > ev.tol]
        if wrong and len(wrong) < len(parts):
            part = ev.records[join.args[wrong[0]]]
            return named(stage.name, part, f"part {wrong[0] + 1} of the {len(parts)} joined at {join.where} differs "
                                         f"from the reference's (error {errors[wrong[0]]:.1e}); the other parts "
                                         "match", ev.matched)
    return None


def _stacked_swap(stage, rec, join, parts: list[torch.Tensor], ev: Evidence) -> Localization | None:
    """The ``stack`` whose two parts, each right, are stacked in the other order (``torch.stack([imag, real])``)."""
    if join.op not in STACKS or len(parts) != 2 or stage.tensor.numel() != rec.value.numel():
        return None
    axes = [a for a in range(join.value.dim()) if join.value.shape[a] == 2
            and join.value.shape[:a] + join.value.shape[a + 1:] == parts[0].shape]
    if not axes:
        return None
    swapped = torch.stack(parts[::-1], dim=axes[-1]).reshape(rec.value.shape)
    fit = best_fit(stage, swapped, ev.tol, strict=False)
    if fit is None or fit.error > ev.tol:
        return None
    return named(stage.name, join, "its 2 parts, each right, are stacked in the other order than the reference's",
                 ev.matched)
