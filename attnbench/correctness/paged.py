"""The paged-decode property (issue 37): decoding through a paged KV cache, its pages shuffled in the pool and the
sequences of the batch at different lengths, equals the float64 reference at every step.

A paged cache (``implementations/paged.py``) has ``set_page_size(n)`` and takes ``forward(x, use_cache=True,
lengths=[...])``: row ``i`` appends its first ``lengths[i]`` tokens, so the rows sit at different positions. Each
case, for every page size of :data:`PAGE_SIZES`:

1. a prefill of different prompt lengths per row (:data:`PROMPTS`), padded to the longest;
2. decode steps where each row appends its next token at its own position (a row that is done appends none), with
   one chunk step of different chunk lengths per row half way;

every row's outputs compared with the reference at their positions. A failure names the page size, the lengths, the
row (sequence) and the position: ``paged decode (page size 4, prompts 5/11/2, pages shuffled): sequence 1, decoded
token at position 12: error 0.83 > tolerance 1e-10``. The block tables (``page_stats()``) say whether the pages of a
sequence were scattered; the message says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from attnbench.correctness.cases import Case, CaseResult, Shape, build, exc_line, inputs, rel_error, row, seed_for, tolerance
from attnbench.devices import DTYPES
from attnbench.plugins import cache_state
from attnbench.spec import AttnSpec
from attnbench.weights import random_weights

PAGE_SIZES = (4, 3)
"""Page sizes each case decodes with: several pages per sequence, and a size that does not divide the lengths."""
PROMPTS = (5, 11, 2)
"""Prompt lengths of the three sequences (the batch's rows)."""
PAGED_SHAPES = [  # seq_len: the longest sequence; the others stop earlier (TOTALS)
    Shape("paged_gqa", 3, 20, AttnSpec(32, 32, 20, 0.0, 4, num_kv_heads=2)),
    Shape("paged_mqa_window", 3, 20, AttnSpec(16, 16, 20, 0.0, 4, num_kv_heads=1, window=5)),  # pages leave the window
]
TOTALS = (13, 20, 9)
"""Tokens each sequence ends with."""
CHUNKS = (3, 1, 2)
"""The one chunk step: tokens each row appends at once (clipped to what it has left)."""


def is_paged(module) -> bool:
    """Whether ``module`` has the paged-cache protocol (``set_page_size``)."""
    return callable(getattr(getattr(module, "_orig_mod", module), "set_page_size", None))


def _steps(start: list[int]) -> Iterator[list[int]]:
    """Per step, the tokens each row appends: single tokens, the chunk step half way, until every row is done."""
    lens, chunked = list(start), False
    while any(n < t for n, t in zip(lens, TOTALS, strict=True)):
        chunk = not chunked and max(lens) >= sum(TOTALS) // len(TOTALS)
        step = [min(c if chunk else 1, t - n) for n, t, c in zip(lens, TOTALS, CHUNKS, strict=True)]
        chunked = chunked or chunk
        lens = [n + s for n, s in zip(lens, step, strict=True)]
        yield step


def _scattered(module) -> str:
    stats = getattr(getattr(module, "_orig_mod", module), "page_stats", None)
    tables = stats().get("block_tables") if callable(stats) else None
    if not tables:
        return "page order not reported (no page_stats())"
    apart = sum(any(b - a != 1 for a, b in zip(t, t[1:], strict=False)) for t in tables if len(t) > 1)
    return f"pages scattered in {apart} of {len(tables)} sequences"


def decode_paged(built, x: torch.Tensor, page_size: int, device) -> Iterator[tuple[str, float]]:
    """``(where, error)`` for every row of every call of one paged decode at ``page_size``."""
    module = built.module
    ref = built.reference(x)
    with cache_state.default_dtype(x.dtype):
        module.set_page_size(page_size)
        cache_state.reset_cache(module)
    lens = [0] * len(PROMPTS)
    for n in [list(PROMPTS), *_steps(list(PROMPTS))]:
        width = max(n)
        part = torch.stack([torch.nn.functional.pad(x[i, lens[i]:lens[i] + width], (0, 0, 0, max(0, lens[i] + width - x.shape[1])))
                            for i in range(len(n))])
        with torch.no_grad(), cache_state.default_dtype(x.dtype):
            out = module(part.to(device), use_cache=True, lengths=n).cpu()
        for i, k in enumerate(n):
            if k:
                what = "prefill" if lens[i] == 0 else "decoded token" if k == 1 else f"chunk of {k}"
                yield (f"sequence {i}, {what} at position {lens[i]}" + (f"-{lens[i] + k - 1}" if k > 1 else ""),
                       rel_error(out[i, :k], ref[i, lens[i]:lens[i] + k]))
        lens = [a + b for a, b in zip(lens, n, strict=True)]


def run_paged_decode(impl, case: Case, device: torch.device) -> CaseResult:
    """Every page size of :data:`PAGE_SIZES` on ``case``'s shape: the first failing row and step, or the worst error."""
    spec = case.shape.spec
    built = build(impl, spec, device, case.dtype, random_weights(spec, seed=seed_for(case.shape)))
    if not is_paged(built.module):
        return row(impl, case, device, "skip", None, None, "not a paged cache (no set_page_size(n): implementations/paged.py)")
    tol = tolerance(case.dtype)
    x = inputs(case.shape, seed=1).to(DTYPES[case.dtype])
    worst, said = 0.0, ""
    for page_size in PAGE_SIZES:
        where = (f"paged decode (page size {page_size}, prompts {'/'.join(map(str, PROMPTS))}, "
                 f"totals {'/'.join(map(str, TOTALS))}, pages shuffled)")
        try:
            for step, err in decode_paged(built, x, page_size, device):
                if not err <= tol:
                    what = "non-finite or mis-shaped output" if math.isinf(err) else f"error {err:.3g}"
                    return row(impl, case, device, "fail", err, tol, f"{where}: {step}: {what} > tolerance {tol:.2g}")
                worst = max(worst, err)
        except Exception as exc:
            return row(impl, case, device, "error", None, None, f"{where} raised {exc_line(exc)}")
        said = _scattered(built.module)
    return row(impl, case, device, "pass", worst, tol,
               f"page sizes {', '.join(map(str, PAGE_SIZES))}, prompts {'/'.join(map(str, PROMPTS))}; {said}")
