"""The ``scope`` axis of a sweep (issue 27): which modes each scope has, and the cells a layer cell becomes.

``layer`` cells are exactly the cells of a sweep without scopes (the model axes 0, the same ``cell_id``), so the
default run measures what it measured before. ``block`` cells wrap the attention in one transformer block; ``model``
cells in a GPT of ``layers`` blocks over a vocabulary of ``vocab`` (and, in the generate modes, ``new_tokens`` greedy
tokens after a prompt of ``seq_len``).
"""

from __future__ import annotations

from dataclasses import replace

from attnbench.errors import SweepError
from attnbench.results.schema import SCOPES, Cell

LAYER_ONLY = ("decode",)
"""Modes of the attention layer alone (a model decodes in ``generate-cache``)."""
MODEL_ONLY = ("generate-cache", "generate-nocache")
"""Modes that need a model (a vocabulary to choose tokens from)."""
SCOPED_ONLY = ("train",)
"""Modes that need a block or model around the attention (an optimizer over its parameters)."""


def check_scopes(scopes, modes, model_axes, values: dict) -> None:
    """A :class:`SweepError` for an unknown scope or a mode no scope of the sweep has."""
    for s in scopes:
        if s not in SCOPES:
            raise SweepError(f"unknown scope {s!r}; use one of {', '.join(SCOPES)}")
    for m in modes:
        if m in MODEL_ONLY and "model" not in scopes:
            raise SweepError(f"--mode {m.split('-')[0]} needs --scope model (a GPT to choose tokens with)")
        if m in SCOPED_ONLY and not set(scopes) - {"layer"}:
            raise SweepError(f"--mode {m} needs --scope block or model (an optimizer over the block's parameters)")
        if m in LAYER_ONLY and "layer" not in scopes:
            raise SweepError(f"--mode {m} times one layer's decode step; at --scope model use --mode generate")
    for axis in model_axes:
        if not values[axis]:
            raise SweepError(f"axis {axis!r} is empty; give at least one value")


def scope_cells(layer: Cell, scope: str, layers, vocab, new_tokens) -> list[Cell]:
    """The cells of ``layer`` (a cell of the other axes) at ``scope``; none where the mode does not exist there."""
    mode = layer.mode
    if scope == "layer":
        return [] if mode in MODEL_ONLY + SCOPED_ONLY else [layer]
    if mode in LAYER_ONLY or (scope == "block" and mode in MODEL_ONLY):
        return []
    if scope == "block":
        return [replace(layer, scope="block")]
    generating = mode in MODEL_ONLY
    return [replace(layer, scope="model", layers=n, vocab=v, new_tokens=m if generating else 0)
            for n in layers for v in vocab for m in (new_tokens if generating else (0,))]
