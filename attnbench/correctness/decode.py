"""The decode property: KV-cache decoding, in the patterns real decoders use, equals the full forward.

For a module with the KV-cache protocol (``implementations/kv_cache.py``), each pattern below decodes a
sequence through ``forward(x, use_cache=True)`` and compares every output with the full-sequence float64
reference at its positions (:meth:`attnbench.correctness.cases.Built.reference`, weights the module lacks
held at zero). The patterns, in the order they run (the first failing step is reported, named by its
pattern and position, e.g. ``decode, uneven chunks: chunk of 3 appended at position 7``):

* ``prefill then single tokens``: one prefill call, then one token at a time;
* ``rewind``: what the decode timer relies on: decode a token, undo it as the timer does (``rewind_cache(1)``,
  or without that method the cache state snapshotted and restored: :mod:`attnbench.plugins.cache_state`), decode
  it again;
* ``uneven chunks``: after the prefill, single tokens mixed with chunks of 2-5 tokens appended to the
  non-empty cache (chunked prefill, speculative decoding; with RoPE each chunk at its absolute positions, the
  cached keys rotated once); with a sliding window, one chunk crosses the
  window's wrap-around (its positions straddle a multiple of the window, where a ring of ``window`` slots
  starts again at slot 0);
* ``eval mode with dropout``: a layer built with dropout 0.2 decodes in eval mode (no dropout anywhere);
* ``after reset_cache()``: a used module, reset, decodes another sequence (a cache not cleared shows);
* ``after reset_cache() with another batch size``: the same with another batch size (buffers kept for the
  first batch show).

Each pattern is a small function ``pattern(d: Decoding) -> Iterator[(where, error)]`` in :data:`PATTERNS`;
a new pattern is one function appended there. Each starts from a freshly built module (:meth:`Decoding.fresh`),
so a failure belongs to its own pattern.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from attnbench.correctness.cases import Built, Case, CaseResult, Shape, build, exc_line, inputs, rel_error, row, seed_for, tolerance
from attnbench.devices import DTYPES
from attnbench.plugins import cache_state
from attnbench.spec import AttnSpec
from attnbench.weights import random_weights

PROTOCOL = ("reset_cache",)
"""What a cache needs besides ``forward(x, use_cache=True)``: a reset method (any name in
:data:`attnbench.plugins.cache_state.RESET_METHODS`); ``rewind_cache`` is optional (restored otherwise)."""

DECODE_SHAPES = [  # (prefill = DECODE_PREFILL tokens, then the patterns up to seq_len)
    Shape("decode_mha", 2, 12, AttnSpec(16, 16, 12, 0.0, 2, True)),  # T == context_length
    Shape("decode_gqa", 2, 11, AttnSpec(32, 32, 16, 0.0, 4, num_kv_heads=2)),
    Shape("decode_mqa_window", 2, 15, AttnSpec(16, 16, 16, 0.0, 4, num_kv_heads=1, window=4)),  # wraps 2x+
    Shape("decode_window_long_prefill", 1, 14, AttnSpec(16, 16, 16, 0.0, 2, True, window=3)),  # prefill > window
    # RoPE (issue 26; where declared): new tokens rotated at their absolute positions, cached keys rotated once
    Shape("decode_rope_gqa_qknorm", 2, 11, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=2, rope_theta=100.0,
                                                      qk_norm="head")),
    Shape("decode_rope_interleaved_window", 1, 12, AttnSpec(16, 16, 12, 0.0, 2, window=4, rope_theta=500_000.0,
                                                              rope_style="interleaved")),
    Shape("decode_rope_half_gqa", 2, 10, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=2, rope_theta=500.0)),  # plain RoPE
    # DeepSeek-style MLA (issue 46; where declared): a low-rank query, interleaved RoPE (DeepSeek's pairs) ...
    Shape("decode_mla_qlora", 2, 11, AttnSpec(32, 32, 12, 0.0, 4, rope_theta=100.0, rope_style="interleaved",
                                              q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
                                              v_head_dim=5)),
    # ... and a full-rank query, rotate-half pairs, d_in != d_out, v_head_dim != qk_head_dim
    Shape("decode_mla_full_q", 1, 12, AttnSpec(24, 16, 12, 0.0, 2, rope_theta=1000.0, kv_lora_rank=10,
                                               qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=4)),
]
DECODE_PREFILL = {"decode_window_long_prefill": 7}  # default 5
EVAL_DROPOUT = 0.2
"""The dropout the eval-mode pattern builds with: eval-mode decoding must not apply it."""
CHUNK_SIZES = (1, 4, 2, 1, 3, 5)
"""Tokens per call after the prefill, cycled (clipped to what is left): single tokens and uneven chunks. The
eval-mode pattern starts the cycle at its last entry, so between them the decode shapes see chunks of 2 to 5."""


def missing_protocol(module: nn.Module) -> list[str]:
    """The KV-cache protocol methods ``module`` lacks (``forward(x, use_cache=True)`` is called, not inspected)."""
    return [] if cache_state.reset_method(module) else ["reset_cache (or reset_kv_cache, clear_cache, ...)"]


@dataclass(frozen=True)
class Step:
    """One cached call: tokens ``start .. start + length - 1``; ``label`` says where it is in the words of a failure."""

    start: int
    length: int
    label: str


def single_steps(start: int, end: int) -> list[Step]:
    """One token at a time from ``start`` to ``end``."""
    return [Step(t, 1, f"decoded token at position {t}") for t in range(start, end)]


def chunk_steps(start: int, end: int, window: int | None = None, sizes: tuple[int, ...] = CHUNK_SIZES) -> list[Step]:
    """Single tokens and uneven chunks (:data:`CHUNK_SIZES`) from ``start`` to ``end``; with a ``window``, the chunk
    at the first multiple ``q`` of the window after ``start`` covers ``q - 1 .. q + 1`` (it crosses the wrap-around)."""
    cross = None
    if window is not None:
        q = (start // window + 1) * window
        if q + 1 < end:
            cross = q - 1  # positions q-1, q, q+1: ring slots window-1, 0, 1
    cycle = itertools.cycle(sizes)
    steps: list[Step] = []
    t, crossed = start, False
    while t < end:
        stop = cross if cross is not None and t <= cross else end
        if t == cross:
            n = min(3, end - t)
            label = (f"chunk of {n} appended at position {t} across the window's wrap-around "
                     f"(window {window}: positions {t}-{t + n - 1})")
        else:
            n = min(next(cycle), stop - t)
            label = f"decoded token at position {t}" if n == 1 else f"chunk of {n} appended at position {t}"
            if crossed:  # a chunk written wrongly across the wrap-around shows in the calls after it
                label += f", after the chunk across the window's wrap-around at position {cross}"
        steps.append(Step(t, n, label))
        crossed = crossed or t == cross
        t += n
    return steps


class StepError(Exception):
    """A cached call raised: ``where`` names the step."""

    def __init__(self, where: str, exc: BaseException) -> None:
        super().__init__(where)
        self.where, self.exc = where, exc


@dataclass
class Decoding:
    """What a pattern is given: the case, its device, the prefill length, and fresh modules on request."""

    impl: object
    case: Case
    device: torch.device
    prefill: int

    @property
    def spec(self) -> AttnSpec:
        """The case's spec."""
        return self.case.shape.spec

    @property
    def length(self) -> int:
        """Tokens per sequence (every pattern decodes up to here)."""
        return self.case.shape.seq_len

    def fresh(self, dropout: float = 0.0) -> Built:
        """A newly built module in eval mode (with ``dropout`` in its spec) and its reference weights."""
        spec = replace(self.spec, dropout=dropout)
        return build(self.impl, spec, self.device, self.case.dtype, random_weights(self.spec, seed=seed_for(self.case.shape)))

    def sequence(self, seed: int, batch: int | None = None) -> torch.Tensor:
        """A seeded input ``(batch, T, d_in)`` in the case's dtype (on the CPU)."""
        return inputs(self.case.shape, batch=batch, seed=seed).to(DTYPES[self.case.dtype])

    def run(self, built: Built, x: torch.Tensor, steps: list[Step], reset: bool = True) -> Iterator[tuple[str, float]]:
        """``reset_cache()``, then each step's tokens of ``x`` through the cache: ``(where, error)`` per step.

        A call that raises becomes a :class:`StepError` naming the step.
        """
        ref = built.reference(x)
        x_dev = x.to(self.device)
        if reset:
            with cache_state.default_dtype(x_dev.dtype):
                cache_state.reset_cache(built.module)
        for step in steps:
            where = step.label
            try:
                # a cache allocated with torch.zeros(..., device=x.device) gets the case's dtype, as in a model run in it;
                # the step's tokens contiguous, as a model's previous layer gives them: a layer that refuses a strided
                # input (GPT-2's x.view(-1, C)) fails strided_input, the one case about strides, not every decode case
                tokens = x_dev[:, step.start:step.start + step.length].contiguous()
                with torch.no_grad(), cache_state.default_dtype(x_dev.dtype):
                    out = built.module(tokens, use_cache=True).cpu()
            except Exception as exc:
                raise StepError(where, exc) from exc
            want = ref[:, step.start:step.start + step.length]
            if out.shape != want.shape:
                where += f" (output shape {tuple(out.shape)} != expected {tuple(want.shape)})"
            yield where, rel_error(out, want)

    def opening(self, prefill: int | None = None) -> list[Step]:
        """The prefill call."""
        n = self.prefill if prefill is None else prefill
        return [Step(0, n, f"prefill of {n} tokens")]


# --- the patterns ---------------------------------------------------------------------------------

def single_tokens(d: Decoding) -> Iterator[tuple[str, float]]:
    """Prefill, then one token at a time."""
    yield from d.run(d.fresh(), d.sequence(1), d.opening() + single_steps(d.prefill, d.length))


def rewind(d: Decoding) -> Iterator[tuple[str, float]]:
    """Single tokens up to the last but one, then that token undone as the timer undoes it (:func:`decode_twice`)
    and decoded again, then the next token (the timer's loop)."""
    built, x = d.fresh(), d.sequence(1)
    t = d.length - 2
    yield from d.run(built, x, d.opening() + single_steps(d.prefill, t))
    want = built.reference(x)[:, t:t + 1]
    try:
        with torch.no_grad(), cache_state.default_dtype(x.dtype):
            out, again, how = decode_twice(built.module, x[:, t:t + 1].contiguous().to(d.device))
    except Exception as exc:
        raise StepError(f"position {t} decoded, undone as the timer does and decoded again", exc) from exc
    yield f"decoded token at position {t}", rel_error(out.cpu(), want)
    yield f"position {t} decoded again after {how}", rel_error(again.cpu(), want)
    yield from d.run(built, x, [Step(t + 1, 1, f"decoded token at position {t + 1} after {how}")], reset=False)


def decode_twice(module: nn.Module, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Decode ``x_t`` ``(b, 1, d_in)``, undo it the way the decode timer does, and decode it again: both outputs
    and how it was undone. Without ``rewind_cache`` the cache state is snapshotted and restored
    (:mod:`attnbench.plugins.cache_state`); a restored step that decodes another token raises
    :class:`~attnbench.plugins.cache_state.CacheRestoreError` (state out of attnbench's reach)."""
    if callable(getattr(getattr(module, "_orig_mod", module), "rewind_cache", None)):
        out = module(x_t, use_cache=True)
        module.rewind_cache(1)
        return out, module(x_t, use_cache=True), "rewind_cache(1)"
    restore = cache_state.step_restorer(module, lambda: module(x_t, use_cache=True))
    out = module(x_t, use_cache=True)
    restore()
    return out, module(x_t, use_cache=True), "restoring the cache state"


def uneven_chunks(d: Decoding) -> Iterator[tuple[str, float]]:
    """Prefill, then single tokens and chunks of 2-5 appended to the non-empty cache (one across the wrap-around)."""
    yield from d.run(d.fresh(), d.sequence(1), d.opening() + chunk_steps(d.prefill, d.length, d.spec.window))


def eval_with_dropout(d: Decoding) -> Iterator[tuple[str, float]]:
    """Built with dropout 0.2, in eval mode: prefill, single tokens and chunks equal the dropout-free forward."""
    sizes = CHUNK_SIZES[-1:] + CHUNK_SIZES[:-1]
    yield from d.run(d.fresh(EVAL_DROPOUT), d.sequence(1), d.opening() + chunk_steps(d.prefill, d.length, d.spec.window, sizes))


def _used(d: Decoding) -> Built:
    """A module that has decoded a whole sequence (its cache full)."""
    built = d.fresh()
    for _ in d.run(built, d.sequence(1), d.opening() + single_steps(d.prefill, d.length)):
        pass
    return built


def reset_same_batch(d: Decoding) -> Iterator[tuple[str, float]]:
    """After a whole sequence, ``reset_cache()`` and another sequence of the same batch size."""
    n0 = max(1, d.prefill - 2)
    yield from d.run(_used(d), d.sequence(2), d.opening(n0) + single_steps(n0, d.length))


def reset_other_batch(d: Decoding) -> Iterator[tuple[str, float]]:
    """After a whole sequence, ``reset_cache()`` and another sequence with another batch size (chunks included)."""
    n0 = max(1, d.prefill - 1)
    yield from d.run(_used(d), d.sequence(3, batch=other_batch(d.case.shape.batch)),
                     d.opening(n0) + chunk_steps(n0, d.length, d.spec.window))


def other_batch(batch: int) -> int:
    """The batch size decoded after the reset: smaller when it can be (a kept buffer then broadcasts silently)."""
    return 1 if batch > 1 else 2


PATTERNS: list[tuple[str, Callable[[Decoding], Iterator[tuple[str, float]]]]] = [
    ("prefill then single tokens", single_tokens),
    ("rewind", rewind),
    ("uneven chunks", uneven_chunks),
    (f"eval mode with dropout={EVAL_DROPOUT}", eval_with_dropout),
    ("another sequence after reset_cache()", reset_same_batch),
    ("another batch size after reset_cache()", reset_other_batch),
]
"""``(name, pattern)`` in the order they run; a failure message starts ``decode, NAME: WHERE``."""


def run_decode(impl, case: Case, device: torch.device) -> CaseResult:
    """Every pattern of :data:`PATTERNS` on ``case``'s decode shape: the first failing step, or the worst error."""
    d = Decoding(impl, case, device, DECODE_PREFILL.get(case.shape.id, 5))
    missing = missing_protocol(d.fresh().module)
    tol = tolerance(case.dtype)  # after a build: a class working in float32 is judged at its working precision
    if missing:
        return row(impl, case, device, "fail", None, None,
                   f"declares kv_cache but lacks the protocol method(s) {', '.join(missing)}")
    worst = 0.0
    for name, pattern in PATTERNS:
        try:
            for where, err in pattern(d):
                if err > tol:
                    what = "non-finite or mis-shaped output" if math.isinf(err) else f"error {err:.3g}"
                    return row(impl, case, device, "fail", err, tol,
                               f"decode, {name}: {where}: {what} > tolerance {tol:.2g}")
                worst = max(worst, err)
        except StepError as exc:
            return row(impl, case, device, "error", None, None, f"decode, {name}: {exc.where} raised {exc_line(exc.exc)}")
    return row(impl, case, device, "pass", worst, tol, f"{len(PATTERNS)} patterns: {', '.join(n for n, _ in PATTERNS)}")
