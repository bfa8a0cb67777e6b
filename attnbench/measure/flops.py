"""Floating-point work: one documented analytic model, a cross-check, and the machine's measured peak.

The analytic model (``analytic_flops``), per forward pass, 2 FLOPs per multiply-add:

* projections: ``2·B·T·d_in·d_out`` for Q, ``2·B·T·d_in·kv_dim`` for each of K and V
  (``kv_dim = num_kv_heads·head_dim``, ``= d_out`` for multi-head attention) and ``2·B·T·d_out·d_out``
  for the output;
* attention: ``QKᵀ`` and ``AV`` over the *useful* query-key pairs only, ``2 · 2·B·H·head_dim · pairs``
  (every query head does its own products, so grouped-query attention saves projections and cache,
  not attention FLOPs): ``T·(T+1)/2`` pairs when causal, ``T²`` when not, and with a window ``w``
  only pairs with ``0 <= i - j < w`` (causal) or ``|i - j| < w`` (a kernel that computes the masked
  pairs too does more work, but that is not useful work, so the same number is credited to every
  implementation);
* masks of issue 37 (:mod:`attnbench.correctness.masks`): a prefix and documents count the pairs they keep as well
  (:func:`masked_pairs`, counted exactly); ALiBi, soft-capping and sinks change no pair. Every row says which count
  it uses in ``flops_count``: ``masked`` (only the pairs the mask keeps, as above), and the kept fraction of the
  ``T²`` pairs in ``mask_density``;
* decode: one new token (``T = 1`` in the projections) against ``min(seq_len + 1, w)`` keys (the
  cached tokens it can see and itself);
* softmax, scaling and masking are not counted (O(B·H·T²), not matmul work);
* backward = 2 × forward (gradients with respect to inputs and weights for each matmul), so
  ``forward+backward`` = 3 × forward; kernels that recompute ``QKᵀ`` in backward (flash) do more
  work than credited.

The decode bytes model (``decode_bytes``), the bytes one decode step must read (a decode step is bound
by memory, so its rows report GB/s, :mod:`attnbench.measure.bandwidth`):

* the KV cache at its current length: keys and values of the ``min(seq_len + 1, w)`` tokens the new token
  attends to (the same keys as the FLOP model), ``2·B·keys·num_kv_heads·head_dim`` elements;
* the projection weights once: ``W_q`` (d_out·d_in), ``W_k`` and ``W_v`` (kv_dim·d_in), ``W_o`` (d_out·d_out)
  and the output bias (d_out), plus q/k/v biases when the layer has them;
* the new token's activations (``B·(d_in + d_out)``) are not counted: they are a rounding error next to the cache.

``dense_flops`` is the same model with all ``T²`` pairs: what ``torch.utils.flop_counter`` counts for
the math implementations, used as a cross-check of the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

BACKWARD_FACTOR = 2.0
MODE_FACTOR = {"inference": 1.0, "forward": 1.0, "forward+backward": 1.0 + BACKWARD_FACTOR, "decode": 1.0}


def attention_pairs(seq_len: int, window: int | None = None, causal: bool = True) -> float:
    """Query-key pairs a query may attend to over a sequence of ``seq_len``: ``0 <= i - j < w`` (causal)
    or ``|i - j| < w`` (non-causal); no window is ``w = seq_len``."""
    T = seq_len
    w = T if window is None else min(window, T)
    one_side = (w - 1) * T - (w - 1) * w / 2  # pairs at distance 1 .. w-1 on one side of the diagonal
    return float(T + one_side if causal else T + 2 * one_side)


def masked_pairs(seq_len: int, window: int | None = None, causal: bool = True, prefix: int | None = None,
                 documents: tuple[int, ...] | None = None) -> float:
    """Query-key pairs the mask keeps (:func:`attnbench.correctness.masks.keep`): :func:`attention_pairs` without a prefix or
    documents, else counted row block by row block (exact, memory bounded)."""
    if prefix is None and not documents:
        return attention_pairs(seq_len, window, causal)
    from attnbench.correctness.masks import keep

    T, total = seq_len, 0
    rows = max(1, (1 << 22) // T)
    j = torch.arange(T)[None, :]
    for start in range(0, T, rows):
        i = torch.arange(start, min(T, start + rows))[:, None]
        total += int(keep(i, j, causal=causal, window=window, prefix=prefix, documents=documents).sum())
    return float(total)


def _flops(batch: int, tokens: int, d_in: int, d_out: int, kv_dim: int, mode: str, pairs: float) -> float:
    projections = 2 * batch * tokens * d_in * (d_out + 2 * kv_dim) + 2 * batch * tokens * d_out * d_out
    attention = 2 * 2 * batch * d_out * pairs  # H·head_dim == d_out
    return float(projections + attention) * MODE_FACTOR[mode]


def _kv_dim(d_out: int, num_heads: int, num_kv_heads: int | None) -> int:
    return d_out if num_kv_heads is None else d_out // num_heads * num_kv_heads


def analytic_flops(batch: int, seq_len: int, d_in: int, d_out: int, mode: str = "forward", *, num_heads: int = 1,
                   num_kv_heads: int | None = None, window: int | None = None, causal: bool = True,
                   prefix: int | None = None, documents: tuple[int, ...] | None = None) -> float:
    """Useful FLOPs of one call of ``mode`` (only the query-key pairs the mask keeps count; see the module)."""
    kv_dim = _kv_dim(d_out, num_heads, num_kv_heads)
    if mode == "decode":
        keys = seq_len + 1 if window is None else min(seq_len + 1, window)
        return _flops(batch, 1, d_in, d_out, kv_dim, mode, keys)
    return _flops(batch, seq_len, d_in, d_out, kv_dim, mode, masked_pairs(seq_len, window, causal, prefix, documents))


def decode_bytes(batch: int, seq_len: int, d_in: int, d_out: int, *, num_heads: int = 1, num_kv_heads: int | None = None,
                 window: int | None = None, element_bytes: int = 4, qkv_bias: bool = False) -> float:
    """Bytes one decode step must read with ``seq_len`` tokens cached: the KV cache it attends over plus the
    projection weights (see the module)."""
    kv_dim = _kv_dim(d_out, num_heads, num_kv_heads)
    keys = seq_len + 1 if window is None else min(seq_len + 1, window)
    cache = 2 * batch * keys * kv_dim
    weights = d_out * d_in + 2 * kv_dim * d_in + d_out * d_out + d_out + ((d_out + 2 * kv_dim) if qkv_bias else 0)
    return float((cache + weights) * element_bytes)


def dense_flops(batch: int, seq_len: int, d_in: int, d_out: int, mode: str = "forward", *, num_heads: int = 1,
                num_kv_heads: int | None = None) -> float:
    """FLOPs when all ``T²`` pairs are computed (what FlopCounterMode counts for the math path)."""
    return _flops(batch, seq_len, d_in, d_out, _kv_dim(d_out, num_heads, num_kv_heads), mode, seq_len * seq_len)


def counted_flops(fn: Callable[[], object]) -> float:
    """FLOPs ``torch.utils.flop_counter.FlopCounterMode`` counts for one call (NaN if it cannot run)."""
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            fn()
    except Exception:  # e.g. ops the counter cannot trace through (compiled graphs): no cross-check
        return math.nan
    return float(counter.get_total_flops())


PEAK_TRIES = 3
"""A peak is the best of this many measurements: one taken in a busy moment (another process on the cores) would
make every cell's fraction of peak too high."""

_best_peaks: dict[tuple[str, str], float] = {}


def peak_gflops(device: str, dtype: str, budget_s: float = 1.0, again: bool = False, floor: float = 0.0) -> float:
    """The machine's achievable GFLOP/s for ``dtype`` matmuls on ``device``, measured with a large GEMM.

    The best of :data:`PEAK_TRIES` tries, measured once per process and (device, dtype); ``again``: measure once
    more and keep the best so far (for a cell found faster than the peak: the first measurement met a busy moment).
    ``floor``: the GEMM ceiling cached for this machine (:func:`attnbench.measure.roofline.ceiling_for`, which the
    measuring processes pass): each try then times :data:`QUICK_SAMPLES` calls, not ten, and the peak is the better
    of the two (issue 49: a second less per measuring process; either may have met a busy moment).
    """
    key = (device, dtype)
    if again or key not in _best_peaks:
        _best_peaks[key] = max(_best_peaks.get(key, 0.0), _measure_peak_gflops(device, dtype, budget_s, floor))
    return _best_peaks[key]


QUICK_SAMPLES = 3
"""Calls per try of the peak GEMM when the machine's cached ceiling already bounds it from below (``floor``)."""


def _measure_peak_gflops(device: str, dtype: str, budget_s: float, floor: float = 0.0) -> float:
    if floor > 0 and math.isfinite(floor):
        return max(floor, *gemm_rates(device, dtype, budget_s / 4, min_samples=QUICK_SAMPLES))
    return max(gemm_rates(device, dtype, budget_s))


def gemm_rates(device: str, dtype: str, budget_s: float, n: int | None = None, min_samples: int = 10) -> list[float]:
    """GFLOP/s of each of :data:`PEAK_TRIES` timings of a large square ``dtype`` GEMM on ``device`` (the median call of
    each, at least ``min_samples`` calls; of side ``n``, by default :func:`gemm_size`): the peak is their best, their
    spread its uncertainty (:mod:`attnbench.measure.roofline`)."""
    from attnbench.devices import parse_device, to_dtype
    from attnbench.measure.timing import time_fn

    dev = parse_device(device)
    dt = to_dtype(dtype)
    n = n or gemm_size(dev.type, dt)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=dev, dtype=dt)
    b = torch.randn(n, n, generator=g).to(device=dev, dtype=dt)
    tries = [time_fn(lambda: torch.mm(a, b), dev, budget_s=budget_s / PEAK_TRIES, target_rel_ci=0.01,
                     min_samples=min_samples) for _ in range(PEAK_TRIES)]
    return [2 * n**3 / t.stats()["median_s"] / 1e9 for t in tries]


def gemm_size(device_type: str, dtype: torch.dtype) -> int:
    """The side of the square GEMM a peak is measured with: 8192 on a GPU; on a CPU 1024 (float32, float64) or 512
    (half precisions, often emulated: seconds per call at 1024)."""
    return 8192 if device_type == "cuda" else (1024 if dtype in (torch.float32, torch.float64) else 512)
