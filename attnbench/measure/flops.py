"""Floating-point work: one documented analytic model, a cross-check, and the machine's measured peak.

The analytic model (``analytic_flops``), per forward pass, 2 FLOPs per multiply-add:

* projections: ``2·B·T·d_in·d_out`` for each of Q, K, V and ``2·B·T·d_out·d_out`` for the output;
* attention: ``QKᵀ`` and ``AV`` over the *useful* causal pairs only, ``T·(T+1)/2`` per head:
  ``2 · 2·B·H·head_dim · T(T+1)/2`` (a kernel that computes the masked half too does more work, but
  that is not useful work, so the same number is credited to every implementation);
* softmax, scaling and masking are not counted (O(B·H·T²), not matmul work);
* backward = 2 × forward (gradients with respect to inputs and weights for each matmul), so
  ``forward+backward`` = 3 × forward; kernels that recompute ``QKᵀ`` in backward (flash) do more
  work than credited.

``dense_flops`` is the same model with all ``T²`` pairs: what ``torch.utils.flop_counter`` counts for
the math implementations, used as a cross-check of the model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

BACKWARD_FACTOR = 2.0
MODE_FACTOR = {"inference": 1.0, "forward": 1.0, "forward+backward": 1.0 + BACKWARD_FACTOR}


def _flops(batch: int, seq_len: int, d_in: int, d_out: int, mode: str, pairs: float) -> float:
    projections = 2 * batch * seq_len * d_in * d_out * 3 + 2 * batch * seq_len * d_out * d_out
    attention = 2 * 2 * batch * d_out * pairs  # H·head_dim == d_out
    return float(projections + attention) * MODE_FACTOR[mode]


def analytic_flops(batch: int, seq_len: int, d_in: int, d_out: int, mode: str = "forward") -> float:
    """Useful FLOPs of one call of ``mode`` (causal: only ``T(T+1)/2`` query-key pairs count)."""
    return _flops(batch, seq_len, d_in, d_out, mode, seq_len * (seq_len + 1) / 2)


def dense_flops(batch: int, seq_len: int, d_in: int, d_out: int, mode: str = "forward") -> float:
    """FLOPs when all ``T²`` pairs are computed (what FlopCounterMode counts for the math path)."""
    return _flops(batch, seq_len, d_in, d_out, mode, seq_len * seq_len)


def counted_flops(fn: Callable[[], object]) -> float:
    """FLOPs ``torch.utils.flop_counter.FlopCounterMode`` counts for one call (NaN if it cannot run)."""
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            fn()
    except Exception:  # e.g. ops the counter cannot trace through (compiled graphs): no cross-check
        return math.nan
    return float(counter.get_total_flops())


@functools.cache
def peak_gflops(device: str, dtype: str, budget_s: float = 1.0) -> float:
    """The machine's achievable GFLOP/s for ``dtype`` matmuls on ``device``, measured with a large GEMM.

    Measured once per process and (device, dtype); the size is chosen so one GEMM takes milliseconds.
    """
    from attnbench.devices import parse_device, to_dtype
    from attnbench.measure.timing import time_fn

    dev = parse_device(device)
    dt = to_dtype(dtype)
    n = 8192 if dev.type == "cuda" else (1024 if dt in (torch.float32, torch.float64) else 512)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=dev, dtype=dt)
    b = torch.randn(n, n, generator=g).to(device=dev, dtype=dt)
    timing = time_fn(lambda: torch.mm(a, b), dev, budget_s=budget_s, target_rel_ci=0.01)
    return 2 * n**3 / timing.stats()["median_s"] / 1e9
