"""Setup cost, measured apart (issue 37): building a padding mask, a block mask, a nested tensor or a block table.

**The protocol.** An implementation whose forward needs such a structure exposes

* ``prepare(self, x, **ctx) -> state``: builds it (for the input ``x`` and the call's context, e.g. ``lengths=``);
* ``forward(self, x, ..., prepared=None, **ctx)``: uses ``prepared`` when given, and calls ``prepare`` itself when
  it is ``None``.

**The policy** (``--setup``, ``[measure] setup``; every row records it in ``setup_policy``):

* ``per-call`` (the default, "as the model would do it: once per forward"): every timed call is ``forward(x)``, which
  runs ``prepare`` and then the attention. A layer cell's call is one forward of that layer, so its time is
  *attention + setup*. (A model of ``L`` layers that shares one mask pays the setup once per forward, i.e.
  ``setup_s / L`` per layer: the ``setup_s`` column lets you compute that.)
* ``once``: ``prepare`` runs once before timing, outside the timed region, and every timed call is
  ``forward(x, prepared=state)``: the time is the *attention alone*.

Either way ``setup_s`` is ``prepare``'s own median time per call, measured apart after the cell is timed (NaN when the
implementation has no ``prepare``), so every row can show attention alone and attention + setup, and no timed call
silently includes or excludes the setup.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnbench.errors import SweepError

POLICIES = ("per-call", "once")
"""``--setup``: whether the timed call includes the implementation's ``prepare`` (see the module)."""
SETUP_BUDGET_S = 0.1
"""Sampling seconds for measuring ``prepare`` apart (after warm-up)."""


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else a :class:`~attnbench.errors.SweepError` naming them."""
    if policy not in POLICIES:
        raise SweepError(f"setup policy {policy!r} is neither per-call nor once (--setup, [measure] setup; docs/varlen.md)")
    return policy


def prepare_of(module) -> Callable | None:
    """``module``'s ``prepare`` (of the module under ``torch.compile`` for a compiled one), or None when it has none."""
    base = getattr(module, "_orig_mod", module)
    fn = getattr(base, "prepare", None)
    return fn if callable(fn) else None


def bind(module, x: torch.Tensor, policy: str, **ctx) -> tuple[Callable[[], torch.Tensor], Callable[[], object] | None]:
    """The call a timed step makes under ``policy``, and the setup alone (None when the module has no ``prepare``).

    ``per-call``: ``module(x, **ctx)`` (the forward prepares); ``once``: ``prepare`` runs now, untimed, and the call
    is ``module(x, prepared=state, **ctx)``."""
    check_policy(policy)
    prepare = prepare_of(module)
    if prepare is None:
        return (lambda: module(x, **ctx)), None

    def setup() -> object:
        with torch.no_grad():
            return prepare(x, **ctx)

    if policy == "per-call":
        return (lambda: module(x, **ctx)), setup
    state = setup()
    return (lambda: module(x, prepared=state, **ctx)), setup


def columns(setup: Callable[[], object] | None, device: torch.device, policy: str) -> dict:
    """The row's ``setup_s`` (``setup``'s median seconds per call, measured apart; NaN without one) and
    ``setup_policy``."""
    if setup is None:
        return {"setup_s": math.nan, "setup_policy": policy}
    from attnbench.measure.timing import time_fn  # here: a measuring worker starts without the statistics (test_overheads)

    timing = time_fn(setup, device, warmup_calls=2, warmup_s=0.01, target_rel_ci=0.05, min_samples=5,
                     budget_s=SETUP_BUDGET_S)
    samples = sorted(timing.samples_s)
    return {"setup_s": float(samples[len(samples) // 2]), "setup_policy": policy}
