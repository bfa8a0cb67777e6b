"""A synthetic run folder with plausible numbers, for tests and for trying ``attnbench report`` without a sweep.

The timings are a model (a fixed overhead plus linear and quadratic terms in T, per implementation) with
log-normal noise, so the report has something to say: crossovers, scaling exponents near 1 and 2, a noisy
cell, out-of-memory and error cells, a skipped cell and a ``compiled:`` implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attnbench.results.schema import Cell, empty_row
from attnbench.results.store import RunStore

# name: (overhead s, linear s per token, quadratic s per token², memory exponent)
MODELS = {
    "weight_split": (20e-6, 0.20e-6, 2.0e-9, 2.0),
    "sdpa": (60e-6, 0.15e-6, 0.6e-9, 1.0),
    "fused_qkv": (15e-6, 0.18e-6, 1.8e-9, 2.0),
    "compiled:sdpa": (25e-6, 0.12e-6, 0.5e-9, 1.0),
}


def sample_stats(samples: Sequence[float]) -> dict:
    """Median, IQR, mean, std, min, max, n and an order-statistic 95% CI of the median, like the runner's."""
    s = np.sort(np.asarray(samples, dtype=float))
    n = len(s)
    med = float(np.median(s))
    half = 1.96 * np.sqrt(n) / 2
    lo_i, hi_i = max(int(np.floor(n / 2 - half)), 0), min(int(np.ceil(n / 2 + half)), n - 1)
    lo, hi = float(s[lo_i]), float(s[hi_i])
    return {"median_s": med, "iqr_s": float(np.quantile(s, 0.75) - np.quantile(s, 0.25)), "mean_s": float(s.mean()),
            "std_s": float(s.std(ddof=1)) if n > 1 else 0.0, "min_s": float(s[0]), "max_s": float(s[-1]), "n": n,
            "ci_low_s": lo, "ci_high_s": hi, "ci_rel": (hi - lo) / 2 / med if med > 0 else float("nan"),
            "samples_s": [float(x) for x in samples]}


def ok_row(cell: Cell, samples: Sequence[float], run_id: str = "", **extra) -> dict:
    """A successful row for ``cell`` from raw per-call samples (seconds)."""
    row = empty_row(cell, run_id)
    row.update(sample_stats(samples))
    row.update(status="ok", error="", calls_per_sample=1, warmup_calls=3, timer="perf_counter", threads=1,
               device_name="synthetic CPU", memory_method="synthetic", host="synthetic", worker="0")
    flops = 8.0 * cell.batch * cell.seq_len * cell.d_model**2 + 4.0 * cell.batch * cell.seq_len**2 * cell.d_model
    row.update(flops=flops, flops_counted=flops, gflops_per_s=flops / row["median_s"] / 1e9)
    row.update(extra)
    if np.isfinite(row.get("peak_gflops_per_s", float("nan"))):
        row["frac_peak"] = row["gflops_per_s"] / row["peak_gflops_per_s"]
    return row


def paired_columns(cell: Cell, baseline: str, speedup: float, ci: tuple[float, float] | None = None,
                   cycle_s: Sequence[float] | None = None, cycle_groups: Sequence[int] | None = None) -> dict:
    """The comparison-group columns of a row: its group, baseline, paired speed-up and CI (default ±3%)."""
    lo, hi = ci if ci is not None else (speedup / 1.03, speedup * 1.03)
    if cell.impl == baseline:
        speedup, lo, hi = 1.0, 1.0, 1.0
    return {"group_id": cell.cell_id.split("|", 1)[1], "baseline": baseline, "speedup": float(speedup),
            "speedup_ci_low": float(lo), "speedup_ci_high": float(hi),
            "cycle_s": [float(x) for x in cycle_s] if cycle_s is not None else [],
            "cycle_groups": [int(x) for x in cycle_groups] if cycle_groups is not None else []}


def paired_speedup(base_cycles: np.ndarray, cycles: np.ndarray, rng: np.random.Generator,
                   resamples: int = 400) -> tuple[float, float, float]:
    """Speed-up ``base / this`` from aligned per-cycle times: the geometric mean of the per-cycle ratios and a
    bootstrap 95% CI over cycles (the model of a paired estimate; the runner's own is hierarchical)."""
    logs = np.log(base_cycles / cycles)
    draws = rng.choice(logs, size=(resamples, len(logs))).mean(axis=1)
    lo, hi = np.quantile(draws, [0.025, 0.975])
    return float(np.exp(logs.mean())), float(np.exp(lo)), float(np.exp(hi))


def failed_row(cell: Cell, status: str, error: str, run_id: str = "") -> dict:
    """A non-ok row (NaN timings) with its status and error text."""
    row = empty_row(cell, run_id)
    row.update(status=status, error=error)
    return row


def _pair_up(store: RunStore) -> None:
    """Fill in ``speedup`` and its CI of every paired row from its own and its baseline's ``cycle_s``."""
    from attnbench.results.store import load_run

    df, _ = load_run(store.path)
    by_cell = {r["cell_id"]: r for r in df.to_dict("records")}
    rng = np.random.default_rng(1)

    def fill(r: dict) -> dict | None:
        if r["status"] != "ok" or not r.get("baseline") or r["impl"] == r["baseline"]:
            return None
        base = by_cell.get(f"{r['baseline']}|{r['group_id']}")
        if base is None or base["status"] != "ok":
            return {**r, "speedup": float("nan"), "speedup_ci_low": float("nan"), "speedup_ci_high": float("nan"),
                    "notes": f"no paired speed-up: the baseline {r['baseline']} failed in this group"}
        s, lo, hi = paired_speedup(np.asarray(base["cycle_s"]), np.asarray(r["cycle_s"]), rng)
        return {**r, "speedup": s, "speedup_ci_low": lo, "speedup_ci_high": hi}

    store.rewrite_cells(fill)


def synthetic_run(root: str | Path, impls: Sequence[str] = ("weight_split", "sdpa", "fused_qkv", "compiled:sdpa"),
                  seq_lens: Sequence[int] = (32, 64, 128, 256, 512), modes: Sequence[str] = ("forward",),
                  dtypes: Sequence[str] = ("float32",), d_model: int = 64, num_heads: int = 4, batch: int = 1,
                  n_samples: int = 25, failures: bool = True, noisy: bool = True, extra_rows: Sequence[dict] = (),
                  run_id: str | None = None, seed: int = 0, meta: dict | None = None, paired: str | None = None,
                  cycles: int = 24, drift_sigma: float = 0.0, slow: dict[str, float] | None = None) -> Path:
    """Write a synthetic run under ``root`` and return its folder (``results.parquet`` written).

    ``paired``: the baseline implementation of paired speed-ups; every group's members then get
    ``cycles`` aligned per-cycle times (the ``cycle_s`` column) sharing one machine drift per cycle
    (log-normal, ``drift_sigma``), and ``speedup`` with its CI from them. ``slow``: implementation ->
    factor its times are multiplied by (a deliberately slowed implementation).
    """
    rng = np.random.default_rng(seed)
    slow = slow or {}
    drift_of: dict[tuple, np.ndarray] = {}  # one drift per cycle, shared by a group's members
    base_meta = {"timestamp": "2025-01-01T12:00:00+00:00", "command": "attnbench run --preset synthetic",
                 "git_commit": "0123456789abcdef0123456789abcdef01234567", "attnbench_version": "0.1.0",
                 "torch_version": "2.5.0", "python_version": "3.12.0", "platform": "Linux-synthetic",
                 "hostname": "synthetic-host", "cpu_model": "Synthetic CPU @ 3.0GHz", "cpu_count": 2,
                 "torch_threads": 1, "cuda_version": None, "gpus": [], "cuda_driver": None,
                 "peak_gflops": {"cpu/float32": 1000.0}}
    store = RunStore(root, run_id=run_id, meta={**base_meta, **(meta or {})})
    largest = max(seq_lens)
    for mode in modes:
        for dtype in dtypes:
            factor = {"inference": 0.8, "forward": 1.0, "forward+backward": 2.6}.get(mode, 1.0)
            factor *= {"float32": 1.0, "bfloat16": 1.7, "float16": 1.9, "float64": 2.0}.get(dtype, 1.0)
            for impl in impls:
                over, lin, quad, mem_k = MODELS.get(impl, (30e-6, 0.2e-6, 1.5e-9, 2.0))
                for t in seq_lens:
                    cell = Cell(impl=impl, dtype=dtype, batch=batch, seq_len=t, num_heads=num_heads, d_model=d_model,
                                mode=mode)
                    if failures and impl == "weight_split" and t == largest and mode == modes[-1]:
                        store.append(failed_row(cell, "oom", f"CUDA out of memory at T={t} (synthetic)"))
                        continue
                    if failures and impl == "fused_qkv" and t == largest and mode == modes[0]:
                        store.append(failed_row(cell, "error", "RuntimeError: synthetic failure\nTraceback (most "
                                                "recent call last):\n  File \"x.py\", line 1"))
                        continue
                    median = factor * batch * (over + lin * t + quad * t * t) * (d_model / 64) * slow.get(impl, 1.0)
                    sigma = 0.25 if (noisy and impl == "fused_qkv" and t == seq_lens[0]) else 0.02
                    samples = median * np.exp(rng.normal(0.0, sigma, n_samples))
                    if paired:
                        drift = drift_of.setdefault((mode, dtype, t), np.exp(rng.normal(0.0, drift_sigma, cycles)))
                        samples = median * drift * np.exp(rng.normal(0.0, 0.01, cycles))  # the cycle times
                        median = float(np.median(samples))
                    extra = {"peak_bytes": 4.0 * batch * num_heads * float(t) ** mem_k * (1 + d_model / 64),
                             "peak_gflops_per_s": 1000.0}
                    if impl.startswith("compiled:"):
                        extra["compile_s"] = 2.0 + 0.001 * t
                        extra["recompiles"] = 0.0
                    if paired:
                        extra.update(paired_columns(cell, paired, 1.0, cycle_s=samples, cycle_groups=[cycles]))
                    store.append(ok_row(cell, samples, **extra))
    if paired:
        _pair_up(store)
    if failures:
        store.append(failed_row(Cell(impl="sdpa", seq_len=seq_lens[0], num_heads=3, d_model=d_model), "skipped",
                                f"d_model={d_model} is not divisible by num_heads=3"))
    for row in extra_rows:
        store.append(row)
    store.finalize()
    return store.path
