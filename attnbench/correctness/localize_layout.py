"""A divergence made by a call that only moves values: named as the split or merge of the heads (issue 47).

``q.reshape(B, H, T, D)`` where ``q.view(B, T, H, D).transpose(1, 2)`` was meant, ``k[:, None].expand(...)`` in the
tiled order where the interleaved one was meant, ``torch.stack(heads, -1).flatten(-2)`` where ``cat`` was: each moves
right values into the head layout and mixes them on the way. No tensor of the split's form matches, and a split is a
stage a class may skip (per-head modules), so the first stage found wrong is a later one (the scores, the weights
applied to the values, the output) and the line traced back is the split itself. That line is named as the stage it
makes: ``q heads``, ``k heads``, ``v heads`` when the right values it moved were a projection's, ``merged heads``
when they were the attention's per-head results. It is renamed only when the call's output has that stage's form and
every tensor it was made from is right.
"""

from __future__ import annotations

from dataclasses import replace

from attnbench.correctness.localize_finding import CHAIN, LAYOUT_OPS, Evidence
from attnbench.correctness.localize_match import has_form
from attnbench.correctness.stages import ORDER

GATHERS = frozenset({"stack", "torch.stack", "cat", "torch.cat", "concat", "torch.concat", "hstack", "torch.hstack"})
"""Calls that put right tensors side by side: a merge of the heads when their inputs are the per-head results."""

MOVES = LAYOUT_OPS | {"Tensor.repeat", "repeat", "Tensor.tile", "tile"}
"""Calls that only move (or copy) values: a split, a repeat of the kv heads, a merge."""

MERGED_FROM = ("probabilities @ V", "merged heads")
"""Stages whose values, moved, are the merged heads."""


RESHAPES = frozenset({"Tensor.view", "Tensor.reshape", "reshape", "Tensor.flatten", "flatten"})
PERMUTES = frozenset({"Tensor.transpose", "transpose", "Tensor.permute", "permute", "Tensor.movedim", "movedim",
                      "Tensor.swapaxes", "Tensor.mT", "Tensor.t", "Tensor.T"})
PASSES = frozenset({"Tensor.contiguous", "Tensor.clone", "clone"})


def misordered_merge(div, ev: Evidence):
    """``div`` moved to the axis permutation that put the attention's per-head results in an order its merge does not
    read: ``x.permute(0, 2, 3, 1)`` (head_dim before the heads) on one line, ``x.reshape(B, T, H * D)`` on the next.
    The values the permutation gives are right (the reference's, moved), so the reshape is where they first go wrong;
    but a reshape reads its input as laid out, and what is wrong is that layout. ``div`` unchanged otherwise."""
    rec = div.rec
    if div.name != "merged heads" or rec.op not in RESHAPES or not rec.inputs:
        return div
    src = ev.records[rec.inputs[0]] if rec.inputs[0] is not None else None
    while src is not None and src.op in PASSES and src.inputs and src.inputs[0] is not None:
        src = ev.records[src.inputs[0]]
    if src is None or src.op not in PERMUTES or (src.path, src.line) == (rec.path, rec.line):
        return div
    names = ev.explained.get(src.index, ())
    if not any(n in MERGED_FROM for n in names):
        return div
    return replace(div, rec=src)


def layout_stage(div, ev: Evidence):
    """``div`` renamed to the split or merge stage its line makes (see the module's doc), or to the stage a dropout
    at its line was given (dropout keeps its input's stage: eval-mode dropout on the probabilities is a bug of the
    probabilities, seen first where they are applied to the values); else ``div`` unchanged."""
    rec = div.rec
    if "dropout" in rec.op.lower():
        given = [n for i in rec.inputs if i in ev.explained for n in ev.explained[i] if n in ORDER and n not in CHAIN]
        earlier = [n for n in given if ORDER.index(n) < ORDER.index(div.name)]
        return replace(div, name=max(earlier, key=ORDER.index)) if earlier else div
    if rec.op not in MOVES and rec.op not in GATHERS:
        return div
    if not rec.inputs or not set(rec.inputs) <= ev.sound or rec.index in ev.explained:
        return div
    target = _target(ev, rec.index)
    if target != "merged heads" and rec.op in GATHERS:
        return div  # right head values put side by side in another order: a rotation's halves (rotate_half), not a split
    if target is None or target not in ORDER or ORDER.index(target) >= ORDER.index(div.name):
        return div
    stage = ev.stage(target)
    if stage is None or not has_form(stage, rec.value):
        return div
    return replace(div, name=target)


def _target(ev: Evidence, index: int) -> str | None:
    """The stage a layout call at record ``index`` makes, by the nearest right tensor it moved: ``X heads`` for a
    projection chain ``X``, ``merged heads`` for the attention's results; ``None`` when they say nothing."""
    explained = sorted((i for i in ev.ancestors(index) if i in ev.explained and i != index), reverse=True)
    if not explained:
        return None
    names = ev.explained[explained[0]]
    chains = {CHAIN[n] for n in names if n in CHAIN}
    if len(chains) == 1:
        return f"{chains.pop()} heads"
    if any(n in MERGED_FROM for n in names):
        return "merged heads"
    return None
