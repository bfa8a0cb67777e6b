"""Issue 48: the mixed serving step in the correctness matrix (the ``mixed_step`` case kind).

One call mixes prefills, a prefill chunk over a cache and single-token decodes over caches of different lengths
(:mod:`attnbench.runner.mixed`, :data:`SPECS`). Every request's new tokens are compared with the float64 reference of
its own sequence at their positions; a failure names the request (``request 3 (decode over 9)``) and its position.
Modules with the paged-cache protocol run it; the others skip it with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnbench.correctness.cases import SEED, Case, CaseResult, Shape, build, exc_line, rel_error, row, seed_for, tolerance
from attnbench.devices import DTYPES
from attnbench.plugins import cache_state
from attnbench.runner import mixed
from attnbench.spec import AttnSpec
from attnbench.weights import random_weights

SPECS = {"mixed_gqa": "2q5_3q1kv9_1q3kv7_1q1kv2", "mixed_mha_window": "1q6_2q1kv12_1q4kv10"}
"""Each mixed shape's batch spec: prefills from empty caches, decodes over caches of 1 to 11 tokens and a chunk over
a cache (the window shape's caches reach past its window of 5)."""
PAGE_SIZE = 4
"""Tokens per page in the mixed cases: a request's cache spans up to 3 pages."""
MIXED_SHAPES = [
    Shape("mixed_gqa", 7, 9, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=2)),
    Shape("mixed_mha_window", 4, 12, AttnSpec(16, 16, 12, 0.0, 2, True, window=5)),
]


def cases() -> list[Case]:
    """The mixed-step cases of the matrix."""
    return [Case("mixed_step", shape, dtype) for shape in MIXED_SHAPES for dtype in ("float64", "float32")]


def run_mixed_step(impl, case: Case, device: torch.device) -> CaseResult:
    """Fill every request's cache, run the mixed step, compare each request's new tokens with its reference."""
    spec, requests = case.shape.spec, mixed.parse_batch_spec(SPECS[case.shape.id])
    built = build(impl, spec, device, case.dtype, random_weights(spec, seed=seed_for(case.shape)))
    if not mixed.runs_mixed(built.module):
        return row(impl, case, device, "skip", None, None, "runs no mixed step (no paged cache: set_page_size(n), "
                   "forward(x, use_cache=True, lengths=...); or attnbench_mixed_step = True)")
    paged = getattr(getattr(built.module, "_orig_mod", built.module), "set_page_size", None)
    if callable(paged):
        paged(PAGE_SIZE)
    x = mixed.inputs(requests, spec.d_in, seed=1 + 1_000_003 * SEED.get()).to(DTYPES[case.dtype])
    ref = built.reference(x)  # (b, longest kv, d_out): causal, so each row's prefix is its own sequence's reference
    x_dev = x.to(device)
    where = f"mixed step {SPECS[case.shape.id]} ({mixed.describe(requests)}{'; pages of 4' if callable(paged) else ''})"
    try:
        with torch.no_grad(), cache_state.default_dtype(x_dev.dtype):
            mixed.fill(built.module, requests, x_dev)
            out = mixed.step(built.module, requests, x_dev).cpu()
    except Exception as exc:
        return row(impl, case, device, "error", None, None, f"{where} raised {exc_line(exc)}")
    tol, worst = tolerance(case.dtype), 0.0
    for i, r in enumerate(requests):
        err = rel_error(out[i, :r.q], ref[i, r.cached:r.kv]) if out.dim() == 3 and out.shape[0] == len(requests) \
            else math.inf
        if not err <= tol:
            what = "non-finite or mis-shaped output" if math.isinf(err) else f"error {err:.3g}"
            return row(impl, case, device, "fail", err, tol, f"{where}: request {i} ({mixed.describe((r,))[2:]}, "
                       f"positions {r.cached}-{r.kv - 1}): {what} > tolerance {tol:.2g}")
        worst = max(worst, err)
    return row(impl, case, device, "pass", worst, tol, f"{len(requests)} requests: {mixed.describe(requests)}")


RUNNERS: dict[str, Callable[..., CaseResult]] = {"mixed_step": run_mixed_step}
CASE_MODES = {"mixed_step": "decode"}
