"""Attention's share of a step's time: hooks around the attention modules of a block or model.

Each attention module gets a forward pre-hook and a forward hook (and, for steps with a backward, a full backward
pre-hook and backward hook) that add the seconds spent inside it; the share of one step is that sum over the step's
wall time. It is measured in a pass of its own after the timing (hooks and the synchronisation they need would
disturb the timed steps), over a few steps, and reported as the median with the 10th..90th percentile spread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from attnbench.devices import synchronize


class AttentionClock:
    """Hooks that add up the seconds spent inside ``modules`` (forward, and backward when ``backward``)."""

    def __init__(self, modules: list[nn.Module], device: torch.device, backward: bool):
        self.device, self.seconds = device, 0.0
        self._start: dict[int, float] = {}
        self.handles = []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._leave))
            if backward:
                self.handles.append(m.register_full_backward_pre_hook(self._enter_bw))
                self.handles.append(m.register_full_backward_hook(self._leave_bw))

    def _tick(self, key: int) -> None:
        synchronize(self.device)
        self._start[key] = time.perf_counter()

    def _tock(self, key: int) -> None:
        synchronize(self.device)
        self.seconds += time.perf_counter() - self._start.pop(key)

    def _enter(self, module, args):
        self._tick(id(module))

    def _leave(self, module, args, out):
        self._tock(id(module))

    def _enter_bw(self, module, grad_out):
        self._tick(-id(module))

    def _leave_bw(self, module, grad_in, grad_out):
        self._tock(-id(module))

    def call(self, step: Callable[[], object]) -> tuple[object, float]:
        """One call of ``step`` with the clock on: its output and the share of its wall time spent in the modules."""
        self.seconds = 0.0
        synchronize(self.device)
        t0 = time.perf_counter()
        out = step()
        synchronize(self.device)
        return out, self.seconds / (time.perf_counter() - t0)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attention_share(step: Callable[[], object], modules: list[nn.Module], device: torch.device, *, backward: bool,
                    steps: int = 5, budget_s: float = 2.0) -> dict[str, float]:
    """``attn_share`` (median over up to ``steps`` steps, at least 3, within about ``budget_s``) and its spread
    (``attn_share_low`` / ``attn_share_high``: 10th and 90th percentiles) of ``step``'s time inside ``modules``."""
    clock = AttentionClock(modules, device, backward)
    shares: list[float] = []
    t_end = time.perf_counter() + budget_s
    try:
        while len(shares) < steps and (len(shares) < 3 or time.perf_counter() < t_end):
            shares.append(clock.call(step)[1])
    finally:
        clock.remove()
    low, mid, high = np.percentile(shares, [10, 50, 90])
    return {"attn_share": float(mid), "attn_share_low": float(low), "attn_share_high": float(high)}


def observed_call(step: Callable[[], object], modules: list[nn.Module], device: torch.device) -> tuple[object, float]:
    """One forward-only call of ``step`` with the clock on: its output and attention's share of its time. The hooks
    cost microseconds per attention call, nothing next to a long call, whose share one call measures (issue 39:
    a 90-second generation averages over its 200 steps and every layer; the share pass would repeat it 3 times)."""
    clock = AttentionClock(modules, device, backward=False)
    try:
        return clock.call(step)
    finally:
        clock.remove()
