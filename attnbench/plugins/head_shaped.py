"""Projections stored with a heads axis of their own (issue 46).

TransformerLens holds its queries as ``W_Q`` of shape ``(n_heads, d_model, d_head)``, its output as ``W_O`` of
``(n_heads, d_head, d_model)`` and its biases as ``b_Q`` of ``(n_heads, d_head)``; Mesh-TensorFlow ports and einsum
code hold ``(heads, head_dim, d_model)``. Each is the canonical matrix (``W_q``: ``(heads * head_dim, d_in)``; ``W_o``
read transposed, ``(heads * head_dim, d_out)``) with its rows split by head:

* ``head_in``: ``(heads, head_dim, cols)``, the rows viewed per head;
* ``in_head``: ``(heads, cols, head_dim)``, the same with its last two axes swapped (TransformerLens's ``W_Q``);
* ``head``: a bias ``(heads, head_dim)``.

Which one a parameter is follows from its shape at the probe, whose sizes all differ; a square case (``cols ==
head_dim``) cannot tell ``head_in`` from ``in_head`` and is not bound so.
"""

from __future__ import annotations

import torch

MODES = ("head_in", "in_head", "head")


def mode(shape: tuple[int, ...], rows: int, cols: int | None, heads: int) -> str:
    """How a parameter of ``shape`` holds a canonical matrix of ``(rows, cols)`` (``cols`` None: a bias of ``rows``)
    split into ``heads``; ``""`` when it does not."""
    if rows % heads:
        return ""
    head_dim = rows // heads
    if cols is None:
        return "head" if shape == (heads, head_dim) else ""
    if head_dim == cols or len(shape) != 3:
        return ""
    return {(heads, head_dim, cols): "head_in", (heads, cols, head_dim): "in_head"}.get(tuple(shape), "")


def to_class(t: torch.Tensor, heads: int, how: str) -> torch.Tensor:
    """The canonical ``t`` (rows first) as the class stores it."""
    t = t.reshape(heads, -1, *t.shape[1:])
    return t.transpose(1, 2) if how == "in_head" else t


def to_reference(t: torch.Tensor, how: str) -> torch.Tensor:
    """The class's ``t`` as the canonical matrix (rows first): the inverse of :func:`to_class`."""
    t = t.transpose(1, 2) if how == "in_head" else t
    return t.reshape(-1, *t.shape[2:])


def describe(how: str) -> str:
    return {"head_in": " viewed (heads, head_dim, cols)", "in_head": " viewed (heads, cols, head_dim)",
            "head": " viewed (heads, head_dim)"}[how]
