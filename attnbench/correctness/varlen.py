"""Variable-length batches in the correctness matrix (issue 37): the ``varlen`` case kind.

A batch of sequences of different lengths (one of them a single token) is given to the implementation in its layout
(``padded`` with random padding rows, or ``packed``; :mod:`attnbench.runner.varlen`) and judged three ways:

1. **token for token against the reference**: the float64 reference runs each sequence alone, and every real token
   of the output must match it within the dtype's tolerance;
2. **documents are independent**: the tokens of one document are redrawn and no other document's output may change;
   one that does is a failure naming the two documents (a mask that lets a token see the previous document);
3. **padding is invisible** (padded layout): the padding rows are redrawn and no real token's output may change (a
   failure says padding rows leak into the output, and which sequence).

Cases run for implementations that declare ``varlen`` (the others skip them with the reason); causal and
bidirectional shapes, float64 and float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnbench.correctness.cases import SEED, Case, CaseResult, Shape, build, rel_error, row, seed_for, tolerance, verdict
from attnbench.devices import DTYPES
from attnbench.runner import varlen as layouts
from attnbench.spec import AttnSpec
from attnbench.weights import random_weights

LENGTHS = {"varlen_causal": (5, 1, 9, 3), "varlen_bias": (2, 7, 4), "varlen_noncausal": (4, 7, 2, 6)}
"""Each varlen shape's lengths: unequal, one of a single token, the longest not first."""
VARLEN_SHAPES = [
    Shape("varlen_causal", 4, 9, AttnSpec(16, 16, 9, 0.0, 2)),
    Shape("varlen_bias", 3, 7, AttnSpec(12, 16, 7, 0.0, 4, True)),  # d_in != d_out, q/k/v biases
    Shape("varlen_noncausal", 4, 7, AttnSpec(16, 16, 7, 0.0, 2, causal=False)),  # padding keys visible unless masked
]
CASE_LENGTHS = {"varlen": "case"}
"""Case kind -> the ``lengths`` :func:`attnbench.resolve.resolve` is asked with (other kinds: rectangles, ``""``)."""
REDRAWN_SCALE = 5.0
"""Redrawn tokens and padding are this many times the input's scale: a leak cannot hide under the tolerance."""


def cases() -> list[Case]:
    """The varlen cases of the matrix."""
    return [Case("varlen", shape, dtype) for shape in VARLEN_SHAPES for dtype in ("float64", "float32")]


def _draw(shape: Shape, lengths, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed tokens ``(tokens, d_in)`` and padding ``(batch, longest, d_in)``, float64, from the run's seed."""
    g = torch.Generator().manual_seed(1 + salt + 1_000_003 * SEED.get())
    packed = torch.randn(sum(lengths), shape.spec.d_in, generator=g, dtype=torch.float64)
    padding = REDRAWN_SCALE * torch.randn(len(lengths), max(lengths), shape.spec.d_in, generator=g, dtype=torch.float64)
    return packed, padding


def run_varlen(impl, case: Case, device: torch.device) -> CaseResult:
    """The ``varlen`` case (see the module): reference token for token, then document and padding independence."""
    shape, dtype = case.shape, DTYPES[case.dtype]
    lengths = LENGTHS[shape.id]
    built = build(impl, shape.spec, device, case.dtype, random_weights(shape.spec, seed=seed_for(shape)))
    layout = layouts.layout_of(built.module)
    packed, padding = (t.to(dtype) for t in _draw(shape, lengths, 0))

    def run(tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = layouts.to_layout(tokens, lengths, layout, pad).to(device)
        with torch.no_grad():
            out = built.module(x, lengths=lengths)
        if tuple(out.shape) != tuple(x.shape[:-1]) + (shape.spec.d_out,):
            raise _Wrong(f"output shape {tuple(out.shape)} != {tuple(x.shape[:-1]) + (shape.spec.d_out,)} "
                         f"(the {layout} layout of its input)")
        return layouts.real_tokens(out.detach().cpu(), lengths, layout)

    try:
        out = run(packed, padding)
    except _Wrong as exc:
        return row(impl, case, device, "fail", math.inf, None, str(exc))
    ref = torch.cat([built.reference(piece[None])[0] for piece in torch.split(packed, list(lengths))])
    tol = tolerance(case.dtype)
    err = rel_error(out, ref)
    leak = _independence(run, out, packed, padding, lengths, layout, tol)
    if leak:
        return row(impl, case, device, "fail", err, tol, leak + (f"; error against the per-sequence reference "
                                                                 f"{err:.3g} > tolerance {tol:.2g}" if err > tol else ""))
    result = verdict(impl, case, device, err, tol, "varlen output (each sequence against its own reference)")
    if result.status == "fail":
        result.message += "; " + _worst_token(out, ref, lengths)
    return result


class _Wrong(Exception):
    """An output of the wrong shape (a failed case, not an error)."""


def _changed(a: torch.Tensor, b: torch.Tensor, tol: float) -> torch.Tensor:
    """``(tokens,)`` bool: where ``a`` and ``b`` differ by more than ``tol`` of their scale."""
    scale = max(float(a.abs().max()), 1e-12)
    return (a.to(torch.float64) - b.to(torch.float64)).abs().amax(dim=-1) > tol * scale


def _independence(run: Callable, out: torch.Tensor, packed: torch.Tensor, padding: torch.Tensor, lengths, layout: str,
                  tol: float) -> str | None:
    """Why the documents (or the padding) are not independent, or None: each document's tokens redrawn in turn, then
    the padding rows; any other document whose output changes is named."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    other, other_pad = _draw_other(packed, padding)
    for d in range(len(lengths)):
        tokens = packed.clone()
        tokens[starts[d]:starts[d + 1]] = other[starts[d]:starts[d + 1]]
        moved = _changed(out, run(tokens, padding), 10 * tol)
        for e in range(len(lengths)):
            hit = moved[starts[e]:starts[e + 1]].nonzero()
            if e != d and len(hit):
                t = int(hit[0])
                return (f"document {e} sees document {d}: its token {t} (packed position {starts[e] + t}) changes when "
                        f"document {d}'s tokens change (the mask lets a token see "
                        f"{'the previous' if e == d + 1 else 'another'} document)")
    if layout == "padded":
        moved = _changed(out, run(packed, other_pad), 10 * tol)
        for e in range(len(lengths)):
            hit = moved[starts[e]:starts[e + 1]].nonzero()
            if len(hit):
                return (f"padding rows leak into the output: sequence {e} (length {lengths[e]} of {max(lengths)} "
                        f"padded) changes at its token {int(hit[0])} when only its padding rows change (a key padding "
                        "mask that lets real tokens see the padding)")
    return None


def _draw_other(packed: torch.Tensor, padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + 1_000_003 * SEED.get())
    other = REDRAWN_SCALE * torch.randn(packed.shape, generator=g, dtype=torch.float64)
    return other.to(packed.dtype), (REDRAWN_SCALE * torch.randn(padding.shape, generator=g, dtype=torch.float64)).to(padding.dtype)


def _worst_token(out: torch.Tensor, ref: torch.Tensor, lengths) -> str:
    """Where the error is largest: ``worst at document d, token t``."""
    t = int((out.to(torch.float64) - ref).abs().amax(dim=-1).argmax())
    start = 0
    for d, n in enumerate(lengths):
        if t < start + n:
            return f"worst at document {d}, token {t - start} (packed position {t})"
        start += n
    return ""


RUNNERS: dict[str, Callable[..., CaseResult]] = {"varlen": run_varlen}
