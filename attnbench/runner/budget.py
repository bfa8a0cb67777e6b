"""What a cell will cost before it runs: its time, its peak memory, its default timeout, and whether it fits.

Run in the measuring process, before a unit's cells are built (:func:`attnbench.runner.group.measure_unit`):

* **time**: the analytic FLOPs of one call (:func:`attnbench.measure.flops.analytic_flops`) at a pessimistic
  share of the machine's peak GFLOP/s (:data:`ANALYTIC_EFFICIENCY`), times the calls a cell makes at least (the
  first call, the warm-up, ``min_samples`` samples, the memory pass and the FLOP count) plus its sampling budget;
* **memory**: a cheap analytic bound first (:func:`memory_bound`: several ``T x T`` score tensors, as eager layers
  hold scores, masked scores and weights at once). Only when that bound is a sizeable share of the memory available,
  or the time is long, is the implementation **calibrated**: built at batch 1 and two small sequence lengths, its
  peak memory and call time measured and fitted (memory as ``a·T + b·T²`` per batch row, time as
  ``c0 + c1·FLOPs``) and extrapolated to the cell. Tiny cells (the test suite, the default grid) pay nothing;
* **timeout** (``cell_timeout_s="auto"``, the default): :data:`SAFETY` times the predicted cell time, never less
  than :data:`FLOOR_S` (:data:`COMPILED_FLOOR_S` for ``compiled:`` cells, whose first call compiles);
* **guard**: a cell predicted to need more memory than is available (``MemAvailable``, or the cgroup's limit less
  its usage when that is lower; free GPU memory on CUDA) is a ``skipped`` row with both numbers, unless
  ``memory_guard`` is off (``--no-memory-guard``).

Predictions are estimates: the row records them (``timeout_s``, ``predicted_s``, ``predicted_peak_bytes``,
``available_bytes``) next to what was measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnbench.errors import SweepError
from attnbench.measure.flops import analytic_flops
from attnbench.results.schema import Cell
from attnbench.results.text import fmt_bytes

FLOOR_S = 120.0
"""The shortest default cell timeout: generous for a tiny cell on a loaded machine, short enough that a hang
costs minutes, not hours."""
COMPILED_FLOOR_S = 600.0
"""The shortest default timeout of a ``compiled:`` cell: its first call compiles (a minute or more when loaded)."""
SAFETY = 4.0
"""The default timeout is this many times the predicted cell time (when that is above the floor)."""
ANALYTIC_EFFICIENCY = 0.1
"""Share of the peak GFLOP/s assumed for an uncalibrated prediction (pessimistic: timeouts err long)."""
UNKNOWN_PEAK_GFLOPS = 20.0
"""GFLOP/s assumed when the machine's peak is not known yet."""
CALIBRATE_MEMORY_SHARE = 0.25
"""Calibrate when the analytic memory bound exceeds this share of the available memory ..."""
CALIBRATE_TIME_S = 30.0
"""... or when the uncalibrated cell time exceeds this."""
LONG_S = 60.0
"""A cell predicted to take longer is announced before it starts."""
CALIBRATION_T = 512
"""The longer of the two calibration sequence lengths (the other is half of it), at batch 1."""


def check_timeout(value) -> None:
    """``cell_timeout_s`` must be ``"auto"``, ``None`` (no timeout) or a number of seconds > 0."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or not math.isfinite(value):
        raise SweepError(f"cell timeout {value!r} is not a number of seconds > 0; give seconds (e.g. 600), "
                         "auto (the default, from the cell's predicted cost) or none (no timeout)")


def parse_timeout(text: str | None, flag: str = "--cell-timeout") -> float | str | None:
    """A timeout flag's text: ``none``/``off`` -> None, ``auto`` -> ``"auto"``, seconds > 0 -> float (0 is refused:
    it would read as no timeout)."""
    word = str(text).strip().lower()
    if word in ("none", "off"):
        return None
    if word == "auto":
        return "auto"
    try:
        seconds = float(word)
    except ValueError:
        raise SweepError(f"{flag} {text!r} is not a number of seconds; give seconds > 0, auto or none") from None
    if not seconds > 0 or not math.isfinite(seconds):
        raise SweepError(f"{flag} {text!r}: a timeout must be > 0 seconds; use {flag} none for no timeout")
    return seconds


def floor_s(cell: Cell) -> float:
    """The shortest default timeout of ``cell``."""
    return COMPILED_FLOOR_S if cell.impl.startswith("compiled:") else FLOOR_S


def seconds(value, cell: Cell | None = None) -> float | None:
    """A ``cell_timeout_s`` setting as seconds: ``"auto"`` without a prediction is the floor."""
    if value == "auto":
        return floor_s(cell) if cell is not None else FLOOR_S
    return value


# ---------------------------------------------------------------- memory available here


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_headroom() -> tuple[float, str] | None:
    """The tightest cgroup-v2 memory limit above this process, less its usage: ``(bytes, path)``."""
    text = _read(Path("/proc/self/cgroup")) or ""
    rel = next((line.split("::", 1)[1] for line in text.splitlines() if line.startswith("0::")), None)
    if rel is None:
        return None
    best = None
    path = Path("/sys/fs/cgroup") / rel.lstrip("/")
    while True:
        limit, used = _read(path / "memory.max"), _read(path / "memory.current")
        if limit and limit != "max" and used and limit.isdigit() and used.isdigit():
            room = float(int(limit) - int(used))
            if best is None or room < best[0]:
                best = (room, str(path / "memory.max"))
        if path == Path("/sys/fs/cgroup") or path.parent == path:
            return best
        path = path.parent


def available_bytes(device: torch.device | str = "cpu") -> tuple[float, str]:
    """Memory a new cell can use on ``device`` now, and where the number comes from."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), "free GPU memory"
    meminfo = _read(Path("/proc/meminfo")) or ""
    avail = next((float(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    cgroup = _cgroup_headroom()
    if cgroup is not None and (avail is None or cgroup[0] < avail):
        return cgroup[0], f"the cgroup limit less its usage ({cgroup[1]})"
    if avail is None:
        return math.inf, "unknown (no /proc/meminfo)"
    return avail, "MemAvailable"


# ---------------------------------------------------------------- the analytic model


def element_bytes(cell: Cell) -> int:
    return torch.empty((), dtype=getattr(torch, cell.dtype)).element_size()


def memory_bound(cell: Cell) -> float:
    """A generous analytic bound of a cell's peak bytes: four ``b·h·T·T`` score tensors and a dozen ``b·T·d``
    activations per forward, three times that with the backward; a decode step attends one token."""
    queries = 1 if cell.mode == "decode" else cell.seq_len
    keys = cell.seq_len + (1 if cell.mode == "decode" else 0)
    scores = cell.batch * cell.num_heads * queries * keys
    acts = cell.batch * keys * cell.d_model
    backward = 3 if cell.attention_mode == "forward+backward" else 1  # a block's or model's training step too
    layers = max(cell.layers, 1)  # a model holds every block's activations for its backward
    return float((4 * scores + 12 * acts) * element_bytes(cell) * backward * layers)


def resident_bytes(cell: Cell) -> float:
    """What the cell holds before its first call: the input and the four projection weights (their gradients too)."""
    grads = 2 if cell.attention_mode == "forward+backward" else 1
    return float((cell.batch * cell.seq_len * cell.d_model + 4 * cell.d_model ** 2) * element_bytes(cell) * grads)


def cell_flops(cell: Cell) -> float:
    if cell.batch_spec:  # issue 48: a mixed step, as a class without a cache runs it (every request's whole sequence)
        from attnbench.runner.mixed import Request, mixed_flops, parse_batch_spec

        every = tuple(Request(r.kv, r.kv) for r in parse_batch_spec(cell.batch_spec))
        return mixed_flops(every, cell.d_model, cell.kv_heads / cell.num_heads, cell.window)
    if cell.scope != "layer":  # a block or a model: its own FLOP model (attention, MLP, LM head; generation's steps)
        from attnbench.models.workload import step_flops

        return step_flops(cell)
    return analytic_flops(cell.batch, cell.seq_len, cell.d_model, cell.d_model, cell.mode, num_heads=cell.num_heads,
                          num_kv_heads=cell.num_kv_heads, window=cell.window, causal=cell.causal)


def calls_at_least(settings) -> int:
    """Calls a cell makes at least: the first, the warm-up, one per sample, the memory pass and the FLOP count."""
    return 1 + settings.warmup_calls + settings.min_samples + 2


# ---------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Peak bytes per batch row ``a·T + b·T²`` and call seconds ``c0 + c1·FLOPs``, fitted at two small lengths."""

    lengths: tuple[int, int]
    per_t: float
    per_t2: float
    c0: float
    c1: float

    def peak_bytes(self, cell: Cell) -> float:
        return cell.batch * (self.per_t * cell.seq_len + self.per_t2 * cell.seq_len ** 2)

    def call_s(self, cell: Cell) -> float:
        return self.c0 + self.c1 * cell_flops(cell)


def _fit(t: tuple[int, int], y: tuple[float, float], x: tuple[float, float], quadratic: bool) -> tuple[float, float]:
    """Two non-negative coefficients through two points: ``y = a·T + b·T²`` (quadratic) or ``y = a + b·x``."""
    if quadratic:
        (t1, t2), (y1, y2) = t, y
        b = (y2 * t1 - y1 * t2) / (t1 * t2 * (t2 - t1))
        a = (y1 - b * t1 * t1) / t1
        if b < 0:
            return max(y2, 0.0) / t2, 0.0
        if a < 0:
            return 0.0, max(y2, 0.0) / (t2 * t2)
        return a, b
    (x1, x2), (y1, y2) = x, y
    slope = (y2 - y1) / (x2 - x1) if x2 > x1 else 0.0
    if slope <= 0:
        return 0.0, max(y2, 0.0) / x2
    return max(y1 - slope * x1, 0.0), slope


def calibrate(cell: Cell, settings, guard: Callable[[], contextlib.AbstractContextManager]) -> Calibration | None:
    """Build ``cell`` at batch 1 and two small sequence lengths, measure each one's peak memory and call time (under
    ``guard``, the cell's deadline), and fit. None when the cell is too short to need it or cannot be built small (the
    cell itself then reports why)."""
    from attnbench.measure.memory import peak_memory
    from attnbench.registry import resolve
    from attnbench.resolve import Ready
    from attnbench.runner.workload import build_workload

    t2 = min(CALIBRATION_T, cell.seq_len // 2)
    lengths = (t2 // 2, t2)
    if lengths[0] < 16 or cell.batch_spec:  # issue 48: a mixed step has no sequence length to scale
        return None
    peaks, times, flops = [], [], []
    try:
        for t in lengths:
            small = dataclasses.replace(cell, batch=1, seq_len=t)
            ready = resolve(small.impl, small)
            if not isinstance(ready, Ready):
                return None
            with guard():
                workload = build_workload(small, seed=settings.seed, ready=ready)
                workload.step()
                peaks.append(peak_memory(workload.step, workload.device).peak_bytes)
                t0 = time.perf_counter()
                for _ in range(2):
                    workload.step()
                times.append((time.perf_counter() - t0) / 2)
            flops.append(cell_flops(small))
            del workload
    except Exception:  # the cell at full size says what is wrong, as its own row
        return None
    if not all(math.isfinite(p) for p in peaks):
        return None
    per_t, per_t2 = _fit(lengths, tuple(peaks), (0.0, 0.0), quadratic=True)
    c0, c1 = _fit(lengths, tuple(times), tuple(flops), quadratic=False)
    return Calibration(lengths, per_t, per_t2, c0, c1)


# ---------------------------------------------------------------- the plan of a cell


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a cell is predicted to cost, its timeout, and why it will not run (``skip``), if it will not."""

    cell_id: str
    predicted_s: float
    call_s: float
    predicted_peak_bytes: float  # NaN: not calibrated (the cell was far from the memory available)
    available_bytes: float
    timeout_s: float | None
    how: str
    skip: str | None = None

    def columns(self) -> dict:
        """The row's prediction columns."""
        return {"timeout_s": math.nan if self.timeout_s is None else float(self.timeout_s),
                "predicted_s": self.predicted_s, "predicted_peak_bytes": self.predicted_peak_bytes,
                "available_bytes": self.available_bytes if math.isfinite(self.available_bytes) else math.nan}

    def announcement(self) -> str | None:
        """One line for a cell predicted to take minutes, before it starts; None for a short one."""
        if self.skip or self.predicted_s < LONG_S:
            return None
        limit = "no timeout" if self.timeout_s is None else f"timeout {_duration(self.timeout_s)}"
        return (f"{self.cell_id}: predicted to take ~{_duration(self.predicted_s)} (~{_duration(self.call_s)} per call, "
                f"{self.how}); {limit}")


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def plan_cell(cell: Cell, settings, peak_gflops_per_s: float | None,
              guard: Callable[[], contextlib.AbstractContextManager]) -> Plan:
    """The :class:`Plan` of ``cell`` under ``settings`` (``cell_timeout_s``: ``"auto"``, seconds or None;
    ``memory_guard``), calibrating it only when the analytic model says it may be large."""
    peak = peak_gflops_per_s if peak_gflops_per_s and math.isfinite(peak_gflops_per_s) else UNKNOWN_PEAK_GFLOPS
    call_s = cell_flops(cell) / (ANALYTIC_EFFICIENCY * peak * 1e9)
    fixed_s = settings.warmup_s + settings.budget_s
    calls = calls_at_least(settings)
    try:
        avail, where = available_bytes(cell.device)
    except Exception:  # a CUDA device that cannot be asked: the cell reports its own error
        avail, where = math.inf, "unknown"
    bound = memory_bound(cell) + resident_bytes(cell)
    predicted_peak, how = math.nan, f"FLOPs at {100 * ANALYTIC_EFFICIENCY:.0f}% of {peak:.0f} GFLOP/s"
    if bound > CALIBRATE_MEMORY_SHARE * avail or fixed_s + calls * call_s > CALIBRATE_TIME_S:
        cal = calibrate(cell, settings, guard)
        if cal is not None:
            predicted_peak = cal.peak_bytes(cell) + resident_bytes(cell)
            call_s = cal.call_s(cell)
            how = f"extrapolated from T={cal.lengths[0]} and {cal.lengths[1]} at batch 1"
    predicted_s = fixed_s + calls * call_s
    value = settings.cell_timeout_s
    timeout = max(floor_s(cell), SAFETY * predicted_s) if value == "auto" else value
    skip = None
    if getattr(settings, "memory_guard", True) and math.isfinite(predicted_peak) and predicted_peak > avail:
        skip = (f"predicted to need ~{fmt_bytes(predicted_peak)} of memory, {fmt_bytes(avail)} available ({where}; "
                f"peak memory {how}); not run, so nothing else on this machine is pushed out of memory. "
                "--no-memory-guard runs it anyway")
    return Plan(cell.cell_id, predicted_s, call_s, predicted_peak, avail, timeout, how, skip)


def unit_timeout(plans: list[Plan]) -> float | None:
    """One timeout for a unit's members (they share a shape): the longest of theirs; None when any has none."""
    live = [p for p in plans if p.skip is None] or plans
    if any(p.timeout_s is None for p in live):
        return None
    return max(p.timeout_s for p in live)

