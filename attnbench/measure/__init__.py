"""Measuring, kept apart from holding and presenting results: time, memory, FLOPs, statistics.

Each function takes a zero-argument callable and a device and returns plain numbers, so a sweep,
the asv suite, a test and a notebook all call the same primitives.
"""

from attnbench.measure.bandwidth import decode_rates, peak_gbytes_per_s
from attnbench.measure.flops import analytic_flops, attention_pairs, counted_flops, decode_bytes, dense_flops, peak_gflops
from attnbench.measure.interleave import InterleavedTiming, time_interleaved
from attnbench.measure.memory import (
    MemoryResult,
    kv_cache_bytes_analytic,
    peak_memory,
    retained_bytes,
    storage_bytes,
)
from attnbench.measure.stats import median_ci, paired_speedup, summarize
from attnbench.measure.timing import Timing, time_fn

__all__ = ["InterleavedTiming", "MemoryResult", "Timing", "analytic_flops", "attention_pairs", "counted_flops",
           "decode_bytes", "decode_rates", "dense_flops", "kv_cache_bytes_analytic", "median_ci", "paired_speedup",
           "peak_gbytes_per_s", "peak_gflops", "peak_memory", "retained_bytes", "storage_bytes", "summarize", "time_fn",
           "time_interleaved"]
