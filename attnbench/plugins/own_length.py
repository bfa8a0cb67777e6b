"""The longest sequence a class takes when nothing it is given sets one, measured (issue 46, round 19).

Code written from scratch often sizes its causal mask or its rotary tables by a module constant or a default its
callers never change (``block_size = 256`` above the class, ``RotaryEmbedding(head_dim, max_seq_len=2048)``), and
its constructor takes no context length. Such a class raises on a longer sequence: that is its own limit, as one
head or one key/value head is, not a wrong function. When no constructor parameter (or config field read) is the
context length, the class is run on a probe at the longest sequence of any case; if it raises there but runs on a
short one, the longest it takes is found by bisection, and cases whose context is longer are skipped as its own
constraint, named in ``check -v``. A class that runs at every length is left as it is.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnbench.plugins import measured
from attnbench.plugins.binding import Binding
from attnbench.plugins.context import bind_context
from attnbench.plugins.loading import first_line

LONGEST = 1024
"""At least the longest sequence (and context length) of any case of the matrix (the low-precision ``T = 1000``)."""


def _runs(binding: Binding, plan, n: int, guard) -> str | None:
    """``None`` when the class runs on ``n`` tokens, else what it raised."""
    probe = replace(binding.probe, context_length=LONGEST)
    try:
        torch.manual_seed(0)
        module = binding(probe).eval()
        if plan is not None:
            module = bind_context(module, plan, probe)
        with measured._bounded(guard), torch.no_grad():
            module(torch.randn(1, n, probe.d_in))
    except measured.ProbeTooSlow:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {first_line(exc)}"[:200]
    return None


def max_length(binding: Binding, plan) -> tuple[int, str] | None:
    """``(n, raised)``: the class takes at most ``n`` tokens and raised ``raised`` on ``n + 1``; ``None`` when a
    parameter sets its context length, it runs at :data:`LONGEST`, or it does not run on a short probe either."""
    if "context_length" in binding.fields or binding.style == "config":
        return None
    guard = type("Guard", (), {})()
    try:
        if _runs(binding, plan, LONGEST, guard) is None:
            return None
        short = binding.probe.context_length
        if _runs(binding, plan, short, guard) is not None:
            return None  # it does not run at all: the cases say why
        good, bad = short, LONGEST
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if _runs(binding, plan, mid, guard) is None else (good, mid)
        return good, _runs(binding, plan, bad, guard) or ""
    except measured.ProbeTooSlow:
        return None


def apply_max_length(binding: Binding, plan, own: dict) -> list[str]:
    """Record the class's own longest sequence in ``own`` (``max_len``); the ``check -v`` lines."""
    found = max_length(binding, plan)
    if found is None:
        return []
    own["max_len"], raised = found
    return [f"context length: at most {found[0]} tokens, its own (no parameter sets it; a probe at {found[0] + 1} "
            f"raised {raised}): cases with a longer context are skipped"]
