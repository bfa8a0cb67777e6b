"""Memory bandwidth: the machine's measured peak (a STREAM-like copy and triad) and a decode step's achieved GB/s.

A decode step reads the whole KV cache and every projection weight to produce one token per sequence: it is
bound by memory, not by FLOPs, so decode rows report GB/s and the fraction of a bandwidth peak measured in
the same run (FlashAttention's ``benchmark_attn``, tritonbench's ``decoding_attention``, FlashInfer's and
xformers' decoding benchmarks report the same). The bytes a step must read are
:func:`attnbench.measure.flops.decode_bytes`.

The peak is STREAM's two kernels over arrays far larger than the caches: ``copy`` (``b = a``: 2 arrays of
traffic) and ``triad`` (``a = b + s·c``: 3 arrays), the better of the two. Like STREAM it counts the bytes
the program asks to move (a write-allocate CPU moves one more array per store than counted).
"""

from __future__ import annotations

import functools
import math

import torch

from attnbench.measure.flops import PEAK_TRIES

CPU_ARRAY_BYTES = 64 * 2**20
"""Each STREAM array on a CPU: 64 MiB, far beyond a last-level cache of tens of MiB (STREAM's rule is 4x)."""
CUDA_ARRAY_BYTES = 512 * 2**20
"""Each array on a GPU: 512 MiB, far beyond an L2 of tens to ~100 MiB."""


def peak_gbytes_per_s(device: str, budget_s: float = 0.5) -> float:
    """The device's achievable memory bandwidth in GB/s (10⁹ bytes/s): the better of a STREAM-like copy and triad
    in float32, measured once per process and device (like :func:`attnbench.measure.flops.peak_gflops`) and, on
    a CPU, per torch thread count (one thread reaches a fraction of what all cores do)."""
    from attnbench.devices import parse_device

    dev = parse_device(device)
    return _peak(str(dev), torch.get_num_threads() if dev.type == "cpu" else 0, budget_s)


@functools.cache
def _peak(device: str, threads: int, budget_s: float) -> float:
    return max(stream_rates(device, budget_s))


def stream_rates(device: str, budget_s: float) -> list[float]:
    """GB/s of each of :data:`~attnbench.measure.flops.PEAK_TRIES` tries, each the better of a copy and a triad
    (in the calling thread count): the peak is their best, their spread its uncertainty (:mod:`attnbench.measure.roofline`)."""
    from attnbench.devices import parse_device
    from attnbench.measure.timing import time_fn

    dev = parse_device(device)
    n = (CUDA_ARRAY_BYTES if dev.type == "cuda" else CPU_ARRAY_BYTES) // 4
    a = torch.ones(n, device=dev)
    b = torch.full((n,), 2.0, device=dev)
    c = torch.full((n,), 0.5, device=dev)
    kernels = {"copy": (lambda: b.copy_(a), 2), "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3)}
    rates = []
    for _ in range(PEAK_TRIES):  # the best of several tries: one in a busy moment would inflate every % of peak
        best = 0.0
        for fn, arrays in kernels.values():
            timing = time_fn(fn, dev, warmup_calls=2, warmup_s=0.0, budget_s=budget_s / len(kernels) / PEAK_TRIES,
                             target_rel_ci=0.02, min_samples=5)
            best = max(best, arrays * n * 4 / timing.stats()["median_s"] / 1e9)
        rates.append(best)
    return rates


def decode_rates(decode_bytes: float, median_s: float, peak: float) -> dict[str, float]:
    """The bandwidth columns of a decode row: ``gbytes_per_s`` (bytes one step must read / median step time) and
    ``frac_peak_bw`` (of the measured ``peak`` GB/s)."""
    gbytes = decode_bytes / median_s / 1e9 if median_s and median_s == median_s else math.nan
    return {"decode_bytes": float(decode_bytes), "gbytes_per_s": gbytes, "peak_gbytes_per_s": float(peak),
            "frac_peak_bw": gbytes / peak if peak and peak == peak else math.nan}
