"""Parts joined in the wrong order (issue 47).

GPT-NeoX rotates the first ``rotary_ndims`` features of each head and joins the rest back:
``key = torch.cat((key, key_pass), dim=-1)``. Joined the other way round, ``torch.cat((key_pass, key), dim=-1)``,
every part is right and the whole matches nothing, so the values look as if they went wrong in the rotation that made
one part. :func:`misjoined` takes the ``cat`` that stands for the first stage nothing matches (or the later one where
that was seen) and joins its parts in each other order: when one of them matches the stage, the ``cat``'s line is
named.
"""

from __future__ import annotations

import itertools

import torch

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_layout import GATHERS
from attnbench.correctness.localize_match import best_fit


def _axis(parts: list[torch.Tensor], joined: torch.Tensor) -> int | None:
    """The axis along which ``parts`` were joined into ``joined``, or ``None``."""
    for axis in range(joined.dim()):
        sizes = [p.shape[axis] if p.dim() == joined.dim() else -1 for p in parts]
        others = all(p.dim() == joined.dim() and p.shape[:axis] + p.shape[axis + 1:] ==
                     joined.shape[:axis] + joined.shape[axis + 1:] for p in parts)
        if others and sum(sizes) == joined.shape[axis]:
            return axis
    return None


def misjoined(div, ev: Evidence) -> Localization | None:
    """The line of a ``cat`` whose parts, joined in another order, give the stage ``div`` found no match for."""
    stage = ev.stage(div.name)
    for rec in (div.rec, div.seen):
        if rec is None or rec.op not in GATHERS or len(rec.args) < 2 or None in rec.args or len(rec.args) > 4:
            continue
        parts = [ev.records[i].value for i in rec.args]
        axis = _axis(parts, rec.value)
        if axis is None:
            continue
        for order in itertools.permutations(range(len(parts))):
            if list(order) == sorted(order):
                continue
            fit = best_fit(stage, torch.cat([parts[i] for i in order], dim=axis), ev.tol)
            if fit is not None and fit.error <= ev.tol:
                words = (f"its {len(parts)} parts, each right, are joined in another order than the reference's: "
                         f"{div.fit.words(ev.tol)}")
                return named(div.name, rec, words, ev.matched)
    return None
