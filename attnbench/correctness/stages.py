"""The float64 reference's named stages, in order (issue 47): what localisation matches a class's intermediates to.

The reference (:func:`~attnbench.correctness.reference.reference_forward`) calls :func:`note` at each stage; outside
:func:`capture` that is one context-variable read and nothing is kept, so the reference's results and cost do not
change. Inside it, each stage's tensor is kept, per-head stages stacked on a head axis. :func:`staged`
returns them as :class:`Stage` objects in a canonical layout whose axes are named: ``b`` batch, ``t`` token, ``h``
head, ``d`` head dimension, ``i``/``j`` query/key position, ``o`` output feature.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_NOTES: contextvars.ContextVar[tuple[dict, bool] | None] = contextvars.ContextVar("attnbench_reference_stages",
                                                                                  default=None)

ORDER = ("q", "k", "v", "q heads", "k heads", "v heads", "normed q", "normed k", "q * cos", "rotate(q)", "k * cos",
         "rotate(k)", "rotated q", "rotated k", "scaled q",
         "scores", "scaled scores", "capped scores", "masked scores", "probabilities", "probabilities @ V", "merged heads", "output")
"""Every stage's name, in the order the reference computes them (``scaled q``: the scale folded into the queries,
a form some classes take; the reference never computes it, it is derived; ``capped scores``: ``C * tanh(s / C)``, with
a soft-cap only; ``q * cos`` and ``rotate(q)``: the terms of ``q cos + rotate(q) sin``, whole-head RoPE at +theta
only, which code in Hugging Face's ``rotate_half`` form computes on lines of their own)."""

OPTIONAL = frozenset({"scaled q", "capped scores", "masked scores", "q * cos", "rotate(q)", "k * cos", "rotate(k)"})
"""Stages a correct class may never produce as a tensor of its own (the scale folded into q; an additive mask or
SDPA skips the masked scores); a failure is named at one only when a candidate fits it up to a factor (or, the
masked scores, masks other positions). The raw scores are skipped only when the scaled q matched."""


@dataclass(frozen=True)
class Stage:
    """One named stage: its float64 tensor in the canonical layout ``axes`` (one letter per axis), whether its head
    axes ``h`` and ``d`` must be merged into one (``True``: a projection) or apart (``False``: heads), and for
    grouped-query keys and values the number of query heads per kv head (a class may repeat them)."""

    name: str
    tensor: torch.Tensor
    axes: str
    merged: bool | None = None  # True: h and d must share one axis (the projection); False: apart (heads); None: any
    group: int = 1


def note(name: str, tensor: torch.Tensor, head: int | None = None) -> None:
    """Keep ``tensor`` as stage ``name`` (head ``head``'s part of it) when inside :func:`capture`; else nothing."""
    held = _NOTES.get()
    if held is None:
        return
    notes, live = held
    kept = tensor if live else tensor.detach().clone()
    if head is None:
        notes[name] = kept
    else:
        notes.setdefault(name, {})[head] = kept


@contextmanager
def capture(live: bool = False):
    """Collect the reference's :func:`note` calls into the dict this yields (stage name -> tensor or head -> tensor):
    detached copies, or with ``live`` the tensors themselves (for their gradients)."""
    notes: dict = {}
    token = _NOTES.set((notes, live))
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def staged(notes: dict, spec) -> list[Stage]:
    """The stages of one reference call's ``notes`` (:func:`capture`) for ``spec``, in :data:`ORDER` (a fused
    ``q, k, v`` first); empty for a spec the staged reference does not cover (DeepSeek-style MLA)."""
    if getattr(spec, "is_mla", False) or "output" not in notes:
        return []
    hd = spec.head_dim

    def heads(t: torch.Tensor) -> torch.Tensor:  # (b, T, H * hd) or (b, T, H, hd) -> (b, T, H, hd)
        return t.unflatten(-1, (-1, hd)) if t.dim() == 3 else t

    group = spec.num_heads // (spec.num_kv_heads or spec.num_heads)
    out: list[Stage] = [_fused(notes, group, hd)]
    for name in ("q", "k", "v"):
        g = group if name != "q" else 1
        out.append(Stage(name, heads(notes[name]), "bthd", True, g))
    for name in ("q", "k", "v"):
        out.append(Stage(f"{name} heads", heads(notes[name]), "bthd", False, group if name != "q" else 1))
    for name in ("normed q", "normed k", "q * cos", "rotate(q)", "k * cos", "rotate(k)", "rotated q", "rotated k"):
        if name in notes:
            on_k = name in ("normed k", "k * cos", "rotate(k)", "rotated k")
            out.append(Stage(name, heads(notes[name]), "bthd", None, group if on_k else 1))
    last_q = heads(notes.get("rotated q", notes.get("normed q", notes["q"])))
    out.append(Stage("scaled q", last_q * spec.score_scale, "bthd", None))
    for name in ("scores", "scaled scores", "capped scores", "masked scores", "probabilities"):
        if name in notes:
            out.append(Stage(name, _stacked(notes[name]), "bhij"))
    out.append(Stage("probabilities @ V", _stacked(notes["probabilities @ V"]), "bhid", False))
    out.append(Stage("merged heads", heads(notes["merged heads"]), "bthd", True))
    out.append(Stage("output", notes["output"], "bto"))
    return out


FUSED = "q, k, v (fused)"
"""The name of the fused projection ``cat(q, k, v)``: a match counts as one for each of q, k and v."""


def _fused(notes: dict, group: int, hd: int) -> Stage:
    """``q, k, v`` side by side: ``(b, T, 3, H, hd)`` (its merges: ``cat(q, k, v, -1)``, ``qkv.permute(2, 0, 3, 1, 4)``)
    when they have as many heads, else ``cat`` only."""
    q, k, v = notes["q"], notes["k"], notes["v"]
    if group == 1:
        return Stage(FUSED, torch.stack([t.unflatten(-1, (-1, hd)) for t in (q, k, v)], dim=2), "btshd")
    return Stage(FUSED, torch.cat([q, k, v], dim=-1), "btf")


def _stacked(per_head: dict[int, torch.Tensor]) -> torch.Tensor:
    """Head parts ``(b, T, ...)`` stacked on axis 1: ``(b, H, T, ...)``."""
    return torch.stack([per_head[h] for h in sorted(per_head)], dim=1)
