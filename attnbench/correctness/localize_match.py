"""Matching a recorded intermediate to a reference stage up to the layouts real code uses (issue 47).

A stage (:class:`~attnbench.correctness.stages.Stage`) is a float64 tensor whose axes are named (``bthd``,
``bhij``, ...). A recorded tensor of shape ``s`` matches it when some *layout* of the stage equals it within the
tolerance: a permutation of the named axes (transposes, ``k.transpose(-2, -1)``) whose neighbouring axes, merged in
their canonical order, give ``s`` (head split and merge, ``(b*h, T, d)``), axes of size 1 dropped or added; the query
axis always before the key axis (scores with them swapped are the bug "queries and keys swapped", never a layout);
for grouped-query keys and values also the kv heads repeated to every query head. Masked positions compare as masked
when both are ``-inf`` or below :data:`MASKED`; other values by the relative max-norm error, and by the error left
after the best scalar factor (a scale folded in elsewhere, or a wrong one). A tensor the size of one head is compared
with each head of a stage (per-head modules).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from attnbench.correctness.stages import FUSED, ORDER, Stage

MASKED = -1e4
"""A score at or below this (``-1e9``, ``finfo.min``, ``-inf``) is a masked one."""


@dataclass(frozen=True)
class Fit:
    """How a recorded tensor compares with a stage in its best layout: ``error`` (relative max-norm), the best scalar
    ``factor`` and the error left after it (``fit``), and ``masks``: positions masked in one and not in the other."""

    error: float
    factor: float
    fit: float
    masks: int = 0
    nonfinite: int = 0  # values inf or nan where the reference's are finite

    def words(self, tol: float) -> str:
        """``off by a factor of 0.25 (error 7.5e-01)``, ``masked differently at 12 positions``, ``inf or nan at 3
        positions where the reference is finite``, or ``error 3.1e-01``."""
        if self.masks:
            return f"masked differently at {self.masks} position{'s' * (self.masks != 1)}"
        if self.nonfinite:
            return f"inf or nan at {self.nonfinite} position{'s' * (self.nonfinite != 1)} where the reference is finite"
        if self.factor == 0 and self.fit == 0:
            return f"zero where the reference's is not (error {self.error:.1e})"
        if self.fit <= tol and math.isfinite(self.factor) and abs(self.factor - 1) > tol:
            return f"off by a factor of {self.factor:.3g} (error {self.error:.1e})"
        return f"error {self.error:.1e}"



def compare(got: torch.Tensor, want: torch.Tensor) -> Fit:
    """:class:`Fit` of ``got`` against ``want`` (same shape), both compared in float64."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    masked_want, masked_got = want <= MASKED, got <= MASKED
    differ = int((masked_want != masked_got).sum())
    if differ:
        return Fit(math.inf, math.nan, math.inf, differ)
    g, w = got[~masked_want], want[~masked_want]
    if not torch.isfinite(g).all():
        return Fit(math.inf, math.nan, math.inf, 0, int((~torch.isfinite(g)).sum()))
    scale = float(w.abs().max().clamp_min(1e-12)) if w.numel() else 1.0
    error = float((g - w).abs().max()) / scale if w.numel() else 0.0
    factor = float((g * w).sum() / (w * w).sum().clamp_min(1e-300)) if w.numel() else 1.0
    fit = float((g - factor * w).abs().max()) / max(abs(factor) * scale, 1e-300) if w.numel() else 0.0
    return Fit(error, factor, fit)


def layouts(stage: Stage, shape: tuple[int, ...], strict: bool = True):
    """Every layout of ``stage`` with ``shape``, as a tensor of that shape (``strict`` False: the head axes may be
    merged or apart whatever the stage says)."""
    variants = [stage.tensor]
    if stage.group > 1 and "h" in stage.axes:  # grouped-query keys/values repeated to every query head
        variants.append(stage.tensor.repeat_interleave(stage.group, dim=stage.axes.index("h")))
    for tensor in variants:
        if tensor.numel() != math.prod(shape):
            continue
        merged = stage.merged if strict else None
        for perm in _perms(stage.axes, tuple(tensor.shape), shape, merged):
            yield tensor.permute(perm).reshape(shape)


def _perms(axes: str, sizes: tuple[int, ...], shape: tuple[int, ...], merged: bool | None):
    """Axis orders of ``sizes`` (named by ``axes``) that, their neighbours merged in canonical order, give ``shape``."""
    keep = [a for a in range(len(sizes)) if sizes[a] > 1]
    ones = [a for a in range(len(sizes)) if sizes[a] == 1]
    target = [s for s in shape if s > 1]
    seen = set()
    for perm in itertools.permutations(keep):
        names = "".join(axes[a] for a in perm)
        if "i" in names and "j" in names and names.index("i") > names.index("j"):
            continue
        groups = _groups([sizes[a] for a in perm], target)
        if groups is None or perm in seen:
            continue
        parts = [perm[s:e] for s, e in groups]
        if any(list(p) != sorted(p) for p in parts):
            continue  # merged axes keep their canonical order: a (d, h) merge mixes heads
        if merged is not None and "h" in names and "d" in names:
            together = any(axes.index("h") in p and axes.index("d") in p for p in parts)
            if together != merged:
                continue
        seen.add(perm)
        yield list(perm) + ones


def _groups(sizes: list[int], target: list[int]) -> list[tuple[int, int]] | None:
    """Consecutive runs of ``sizes`` whose products are ``target``, in order, or ``None``."""
    out, start = [], 0
    for want in target:
        prod, end = 1, start
        while end < len(sizes) and prod < want:
            prod *= sizes[end]
            end += 1
        if prod != want or end == start:
            return None
        out.append((start, end))
        start = end
    return out if start == len(sizes) else None


def best_fit(stage: Stage, value: torch.Tensor, tol: float, strict: bool = True) -> Fit | None:
    """The best :class:`Fit` of ``value`` over ``stage``'s layouts (the first within ``tol`` ends the search), or
    ``None`` when no layout has its shape. A tensor of one head's size is compared with each head of the stage
    (:func:`head_slices`: per-head modules, each computing its own head)."""
    best = None
    for arranged in _arranged(stage, tuple(value.shape), strict, value.numel(), value):
        fit = compare(value, arranged)
        if best is None or (fit.error, fit.fit) < (best.error, best.fit):
            best = fit
        if fit.error <= tol:
            break
    return best


def _arranged(stage: Stage, shape: tuple[int, ...], strict: bool, numel: int, value: torch.Tensor | None = None):
    """The layouts of ``stage`` with ``shape``, or of each of its heads when ``shape`` is one head's."""
    yield from layouts(stage, shape, strict)
    heads = stage.tensor.shape[stage.axes.index("h")] if "h" in stage.axes else 1
    if heads > 1 and numel * heads == stage.tensor.numel() and stage.name in ORDER:
        for part in head_slices(stage):
            yield from layouts(part, shape, strict)
    if "i" in stage.axes and numel < stage.tensor.numel() and (strict or BLOCKED[0]):
        for part in blocks(stage, shape, value):
            yield from layouts(part, shape, strict)


BLOCKED = [False]
"""Whether the replay being localised computes blocks (set by :func:`matches`: some tensor equals a block of a stage
exactly). Only then is a tensor of a block's shape a candidate for a stage nothing matched: elsewhere a slice of q
(``x[..., ::2]``) has the shape of a few columns of the scores, and is no evidence of them."""
MAX_BLOCKS = 24
MAX_PLANE = 64 * 64
"""Blocks are looked for in stages of at most this many query-key pairs (the matrix's small shapes; a long case's
thousands of blocks would cost more than its localisation may)."""
"""At most this many blocks of one stage are tried against one tensor whose first value anchors none."""


def blocks(stage: Stage, shape: tuple[int, ...], value: torch.Tensor | None = None):
    """``stage`` cut into the blocks a blocked computation makes one at a time: query chunks (rows ``s:s+c`` of the
    scores, the probabilities or ``probabilities @ V``, with the keys a causal chunk reads, or all of them) and key
    blocks (columns ``s:s+c`` of the scores: a flash-style online softmax), each as a stage of its own. Only a tensor
    whose leading axes are the stage's batch and heads and whose last two are a block's rows and columns is cut for;
    where its first value is found in the stage, the blocks start there, else at multiples of its sizes."""
    axes, t = stage.axes, stage.tensor
    i, j = axes.index("i"), (axes.index("j") if "j" in axes else None)
    if axes[:2] != "bh" or len(shape) != len(axes) or tuple(shape[:2]) != tuple(t.shape[:2]):
        return
    r, c = shape[2], shape[3]
    n_i, n_c = t.shape[i], t.shape[3]
    if r > n_i or c > n_c or (r, c) == (n_i, n_c) or n_i * n_c > MAX_PLANE or (j is None and c != n_c):
        return  # probabilities @ V is cut by its rows only: its last axis is the head's features
    for start, col in _anchored(t, value, r, c) or _gridded(n_i, n_c, r, c, j is not None):
        block = t.narrow(i, start, r)
        yield Stage(stage.name, block.narrow(3, col, c), axes, stage.merged, stage.group)


def _anchored(t: torch.Tensor, value: torch.Tensor | None, r: int, c: int) -> list[tuple[int, int]]:
    """Where in ``t``'s first batch and head the first value of ``value`` (not a masked one) stands, as block starts."""
    if value is None or value.dim() != 4 or not math.isfinite(float(value[0, 0, 0, 0])) or value[0, 0, 0, 0] <= MASKED:
        return []
    plane = t[0, 0].to(torch.float64)
    v = float(value[0, 0, 0, 0])
    hits = ((plane - v).abs() <= 1e-6 * max(1.0, abs(v))).nonzero().tolist()
    return [(p, q) for p, q in hits if p + r <= plane.shape[0] and q + c <= plane.shape[1]][:MAX_BLOCKS]


def _gridded(n_i: int, n_c: int, r: int, c: int, keys: bool) -> list[tuple[int, int]]:
    """Block starts at multiples of the block's sizes (rows; columns from 0, or at multiples too for key blocks)."""
    cols = sorted({0, *(range(0, n_c - c + 1, c) if keys else ())})
    return [(s, q) for s in _starts(n_i, r) for q in cols][:MAX_BLOCKS]


def _starts(n: int, c: int) -> list[int]:
    """Where blocks of ``c`` start in ``n``: every multiple of ``c``, and the last block's start when ``c`` does not
    divide ``n``."""
    return sorted({*range(0, n - c + 1, c), n - c})


def head_slices(stage: Stage) -> list[Stage]:
    """``stage`` head by head: each head's tensor with the head axis dropped (what a per-head ``Head`` module of
    Karpathy's ``nn.ModuleList`` computes), in head order."""
    axis = stage.axes.index("h")
    axes = stage.axes.replace("h", "")
    return [Stage(stage.name, part, axes, None) for part in stage.tensor.unbind(axis)]


def matches(records: list, stages: list[Stage], tol: float) -> tuple[dict, dict[int, list[str]]]:
    """Stage name -> the first record equal to it within ``tol`` (a fused ``q, k, v`` counts for each; the output only
    when nothing unexplained follows it), and record index -> the stages it equals (the explained records)."""
    matched: dict = {}
    explained: dict[int, list[str]] = {}
    BLOCKED[0] = False
    for rec in records:
        for stage in stages:
            fit = best_fit(stage, rec.value, tol)
            if fit is not None and fit.error <= tol:
                BLOCKED[0] |= "i" in stage.axes and _a_block(stage, rec.value)
                explained.setdefault(rec.index, []).append(stage.name)
                for name in (("q", "k", "v") if stage.name == FUSED else (stage.name,)):
                    matched.setdefault(name, rec)
    out = matched.get("output")
    if out is not None and any(r.index > out.index and r.index not in explained for r in records):
        del matched["output"]  # the class went on computing from its output: what it returns is a later tensor
    for index, name in repeated_heads(records, stages, tol, explained):
        explained[index].remove(name)
        if not explained[index]:
            del explained[index]
    return matched, explained


def _a_block(stage: Stage, value: torch.Tensor) -> bool:
    """Whether ``value`` (equal to a layout of ``stage``) holds less than the stage and not one head of it: a block."""
    heads = stage.tensor.shape[stage.axes.index("h")] if "h" in stage.axes else 1
    return value.numel() < stage.tensor.numel() and value.numel() * heads != stage.tensor.numel()


def repeated_heads(records: list, stages: list[Stage], tol: float, explained: dict[int, list[str]]) -> list[tuple[int, str]]:
    """``(record, stage)`` pairs of a per-head loop that makes one head of a stage again, from other tensors than the
    first time, while another head of it is never made (every head reading the first head's values,
    ``v_all[..., :hs]``): each such record equals a head of the stage, but not the head its iteration needed."""
    found = []
    for stage in stages:
        if "h" not in stage.axes or stage.name not in ORDER:
            continue
        parts = head_slices(stage)
        made: dict[int, set[int]] = {}  # head -> the records that made it (and those computed from them)
        again = []
        for rec in records:
            if stage.name not in explained.get(rec.index, ()) or rec.value.numel() * len(parts) != stage.tensor.numel():
                continue
            heads = [h for h, part in enumerate(parts) if (fit := best_fit(part, rec.value, tol)) is not None
                     and fit.error <= tol]
            if len(heads) != 1:
                continue
            if heads[0] in made and not made[heads[0]] & set(rec.inputs):
                again.append(rec.index)
            made.setdefault(heads[0], set()).add(rec.index)
        if again and len(made) < len(parts):
            found += [(i, stage.name) for i in again]
    return found


def has_form(stage: Stage, value: torch.Tensor) -> bool:
    """Whether some layout of ``stage`` (or of one of its heads) has ``value``'s shape."""
    return next(_arranged(stage, tuple(value.shape), False, value.numel()), None) is not None
