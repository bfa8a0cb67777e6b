"""Packed variable-length batches (issue 37): the ``lengths`` axis of a cell and the workload that runs it.

A cell with ``lengths`` set holds ``batch`` sequences of *different* lengths whose total is exactly
``batch x seq_len`` tokens, whatever the distribution: ``seq_len`` is the mean length, so a sweep over
``--lengths`` holds the token count fixed and varies only the shape of the distribution. The distributions
(FlashAttention's ``benchmark_varlen_sched.py`` sweeps the same four names; the draws below are attnbench's own):

* ``constant``: every sequence ``seq_len`` (a rectangle, run through the variable-length paths);
* ``uniform:LO-HI``: integers drawn uniformly from ``LO..HI``, then scaled to the total (so the spread ``HI/LO`` is
  kept; with ``--seq (LO+HI)/2`` the draws stay within a few percent of ``LO..HI``);
* ``longtail``: log-normal, ``exp(z)`` with ``z ~ N(0, 1)``: most sequences short, a few several times the mean
  (the median is about 0.6 of the mean);
* ``bimodal``: ``round(0.2 x batch)`` long sequences (at least one when ``batch >= 2``), the rest short; short
  lengths uniform in ``[0.5, 1.5]``, long ones uniform in ``[4, 12]`` (relative), then scaled to the total;
* ``FILE``: a text file of lengths (integers separated by spaces, commas or newlines): with exactly ``batch`` of
  them, those in order; otherwise ``batch`` drawn from them with replacement; then scaled to the total.

Scaling to the total rounds down, gives every sequence at least one token and hands the remainder to the largest
fractional parts. The draw depends on the run's ``seed``, the distribution, ``batch`` and ``seq_len`` only, so every
implementation of a comparison group runs the same batch.

An implementation of such a cell (``implementations/varlen.py``; ``varlen=True``) takes the batch in its own
*layout*: ``padded`` ``(batch, longest, d_model)`` (right padding) or ``packed`` ``(1, tokens, d_model)`` (the
sequences one after another), built outside the timed region as a data loader would, with the lengths as
``forward(x, lengths=...)``. FLOPs count the real lengths only (:func:`varlen_flops`), so padding earns nothing.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnbench.errors import SweepError
from attnbench.measure.flops import analytic_flops

DISTRIBUTIONS = ("constant", "uniform:LO-HI", "longtail", "bimodal", "FILE")
"""What ``--lengths`` takes (``""``/``none``: a rectangular batch, the default)."""
LONG_SHARE = 0.2
"""``bimodal``: the share of long sequences."""
FLOPS_COUNT = "real-lengths"
"""The ``flops_count`` of a variable-length row: the sum over its sequences of each one's own attention at its real
length (padding not counted), so that GFLOP/s and speed-ups compare equal work."""
LAYOUTS = ("padded", "packed")

_UNIFORM = re.compile(r"^uniform:(\d+)-(\d+)$")


def canonical(text) -> str:
    """``text`` (one ``--lengths`` value) checked and in the spelling cells use; ``""`` for a rectangular batch."""
    value = "" if text is None or str(text).strip().lower() in ("", "none", "rect") else str(text).strip()
    if value in ("", "constant", "longtail", "bimodal"):
        return value
    m = _UNIFORM.match(value)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi:
            raise SweepError(f"--lengths {value}: give 1 <= LO <= HI (e.g. uniform:64-512)")
        return value
    if Path(value).expanduser().is_file():
        _file_lengths(value)  # readable, positive integers
        return value
    raise SweepError(f"--lengths {value!r} is not a length distribution: use constant, uniform:LO-HI, longtail, "
                     "bimodal or a file of lengths (docs/varlen.md), or none for rectangular batches")


def parse_lengths(value) -> tuple[str, ...]:
    """The ``lengths`` axis from a TOML list or a flag's comma-separated text."""
    items = list(value) if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(dict.fromkeys(canonical(v) for v in items)) or ("",)


def _file_lengths(path: str) -> list[int]:
    text = Path(path).expanduser().read_text()
    try:
        values = [int(t) for t in re.split(r"[\s,]+", text.strip()) if t]
    except ValueError:
        raise SweepError(f"--lengths {path}: the file must hold integers separated by spaces, commas or newlines") from None
    if not values or min(values) < 1:
        raise SweepError(f"--lengths {path}: the file holds no lengths, or a length below 1")
    return values


def _weights(text: str, batch: int, rng: np.random.Generator) -> np.ndarray:
    """The relative lengths of ``text``'s distribution (before scaling to the total)."""
    if text == "constant":
        return np.ones(batch)
    if text == "longtail":
        return np.exp(rng.standard_normal(batch))
    if text == "bimodal":
        n_long = max(1, round(LONG_SHARE * batch)) if batch >= 2 else 0
        w = rng.uniform(0.5, 1.5, batch)
        long = rng.permutation(batch)[:n_long]
        w[long] = rng.uniform(4.0, 12.0, n_long)
        return w
    m = _UNIFORM.match(text)
    if m:
        return rng.integers(int(m.group(1)), int(m.group(2)) + 1, batch).astype(float)
    values = _file_lengths(text)
    return np.array(values if len(values) == batch else rng.choice(values, batch), dtype=float)


def draw_lengths(text: str, batch: int, seq_len: int, seed: int = 0) -> tuple[int, ...]:
    """``batch`` lengths of the distribution ``text`` summing to exactly ``batch x seq_len`` (see the module)."""
    text = canonical(text)
    if not text:
        return (seq_len,) * batch
    rng = np.random.default_rng([seed, zlib.crc32(text.encode()), batch, seq_len])
    w = _weights(text, batch, rng)
    total = batch * seq_len
    raw = w / w.sum() * total
    out = np.maximum(np.floor(raw).astype(np.int64), 1)
    order = np.argsort(-(raw - np.floor(raw)), kind="stable")
    i = 0
    while out.sum() < total:  # the remainder to the largest fractional parts
        out[order[i % batch]] += 1
        i += 1
    while out.sum() > total:  # the minimum of one token pushed the sum over: take from the longest
        out[int(np.argmax(out))] -= 1
    return tuple(int(v) for v in out)


def summary(lengths) -> dict:
    """The row's columns describing the lengths: tokens, min / median / max and the padding share."""
    arr = np.asarray(lengths)
    tokens = int(arr.sum())
    return {"tokens": tokens, "lengths_min": int(arr.min()), "lengths_median": float(np.median(arr)),
            "lengths_max": int(arr.max()), "padding_frac": 1.0 - tokens / (len(arr) * int(arr.max()))}


def varlen_flops(lengths, d_model: int, mode: str, num_heads: int, causal: bool = True) -> float:
    """Useful FLOPs of one call over the real lengths: each sequence's own projections and attention
    (:func:`attnbench.measure.flops.analytic_flops` at its length), summed; padding counts nothing."""
    return float(sum(analytic_flops(1, n, d_model, d_model, mode, num_heads=num_heads, causal=causal) for n in lengths))


def pad(packed: torch.Tensor, lengths, fill: torch.Tensor | None = None) -> torch.Tensor:
    """``(tokens, d)`` -> ``(batch, longest, d)``, right-padded with ``fill`` (same shape as the result) or zeros."""
    out = torch.zeros(len(lengths), max(lengths), packed.shape[-1], dtype=packed.dtype) if fill is None else fill.clone()
    for i, piece in enumerate(torch.split(packed, list(lengths))):
        out[i, :piece.shape[0]] = piece
    return out


def unpad(padded: torch.Tensor, lengths) -> torch.Tensor:
    """``(batch, longest, d)`` -> ``(tokens, d)``: the real tokens of each sequence, in order."""
    return torch.cat([padded[i, :n] for i, n in enumerate(lengths)])


def to_layout(packed: torch.Tensor, lengths, layout: str, padding: torch.Tensor | None = None) -> torch.Tensor:
    """The batch ``packed`` ``(tokens, d)`` in ``layout``: ``packed`` ``(1, tokens, d)`` or ``padded``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown varlen layout {layout!r}; one of {LAYOUTS}")
    return packed.unsqueeze(0) if layout == "packed" else pad(packed, lengths, padding)


def real_tokens(out: torch.Tensor, lengths, layout: str) -> torch.Tensor:
    """An implementation's output in ``layout`` -> ``(tokens, d)``, the real tokens only."""
    return out[0] if layout == "packed" else unpad(out, lengths)


def layout_of(module) -> str:
    """The input layout a variable-length module takes (its ``varlen_layout``, default ``packed``)."""
    base = getattr(module, "_orig_mod", module)
    return str(getattr(base, "varlen_layout", "packed"))


# ---------------------------------------------------------------- the workload


@dataclass
class VarlenParts:
    """What a variable-length workload adds to a layer's: the lengths, the layout, the packed input."""

    lengths: tuple[int, ...]
    layout: str
    packed: torch.Tensor  # (tokens, d_model) on the CPU in the cell's dtype: the real tokens


def draw_inputs(cell, seed: int) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """The cell's lengths, its packed tokens ``(tokens, d_model)`` and a padded batch's padding values
    ``(batch, longest, d_model)`` (random, not zeros: a padding key that leaks must change the output), float32."""
    lengths = draw_lengths(cell.lengths, cell.batch, cell.seq_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    packed = torch.randn(sum(lengths), cell.d_model, generator=g)
    padding = 3.0 * torch.randn(len(lengths), max(lengths), cell.d_model, generator=g)
    return lengths, packed, padding


def check_output(out, cell, parts: VarlenParts, x: torch.Tensor) -> str | None:
    """Why ``out`` is not a valid output of the variable-length cell (shape, dtype, non-finite real tokens)."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    want = tuple(x.shape[:-1]) + (cell.d_model,)
    if tuple(out.shape) != want:
        return f"output shape {tuple(out.shape)} != expected {want} (the {parts.layout} layout of its input)"
    if out.dtype != x.dtype:
        return f"output dtype {out.dtype} != input dtype {x.dtype}"
    if not bool(torch.isfinite(real_tokens(out.detach(), parts.lengths, parts.layout)).all()):
        return "output has non-finite values (nan/inf) at real tokens"
    return None


def mode_step(module, x: torch.Tensor, mode: str, call: Callable[[], torch.Tensor],
              grad_out: torch.Tensor | None) -> Callable[[], torch.Tensor]:
    """One step of ``mode``: ``inference`` under ``torch.no_grad`` (nested tensors refuse ``inference_mode`` in torch
    2.13: "Cannot set version_counter for inference tensor", so every variable-length path runs under no_grad alike),
    ``forward`` with autograd recording, ``forward+backward`` with the backward of ``grad_out``."""
    if mode == "inference":
        module.eval()

        def step() -> torch.Tensor:
            with torch.no_grad():
                return call()
        return step
    module.train()
    if mode == "forward":
        return call
    x.requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]

    def backward_step() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        out = call()
        out.backward(grad_out)
        return out
    return backward_step


def modes_allowed(cell) -> None:
    """Variable-length cells are layer cells of inference, forward or forward+backward."""
    if cell.scope != "layer" or cell.mode not in ("inference", "forward", "forward+backward"):
        raise SweepError(f"--lengths {cell.lengths}: variable-length batches run at layer scope in inference, forward "
                         f"or forward+backward (not {cell.scope} scope, mode {cell.mode})")
