"""A cache under a name attnbench does not know, found by what it does (issue 46).

``forward(x, past_kv=None)`` returning ``(out, new_kv)`` keeps its keys and values in what it returns, under a name no
table lists (``past_kv``, ``kv``, ``prev``, ``state``...). Such a parameter is a cache when passing back what a call
returned continues that call as one longer call would: prefill three tokens, step the fourth with the returned value,
and the step's output equals the fourth row of a four-token call. Only a parameter that defaults to None is tried
(a cache is absent at the first step), one at a time; one that does not continue so (a cross-attention input, a
buggy cache) is left as it is, and the class keeps no cache as far as attnbench knows. ``-v`` says which was found.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from attnbench.plugins import signatures
from attnbench.plugins.context import KNOWN_NAMES, ContextPlan, bind_context, plain_type


def candidates(target) -> list[str]:
    """The forward's parameters after ``x`` that default to None under names no table knows, not typed as a plain
    int, float, bool or str."""
    try:
        params = list(signatures.signature(target.forward).parameters.values())[2:]  # self, x
    except (AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is None and p.name not in KNOWN_NAMES and p.kind != p.VAR_KEYWORD
            and not plain_type(p)]


def with_probed_cache(binding, plan: ContextPlan) -> ContextPlan:
    """``plan`` with the first candidate that continues a call as a cache (:func:`continues`) as its cache; ``plan``
    itself when it has a cache already, or no candidate does."""
    if plan.cache is not None or plan.attr_cache:
        return plan
    for name in (n for n in candidates(binding.target) if n not in {*plan.probed, *plan.inputs, *plan.tables}):
        trial = replace(plan, cache=name, cache_probed=True)
        if continues(binding, trial):
            return trial
    return plan


def continues(binding, plan: ContextPlan) -> bool:
    """Does a step with what a three-token call returned give the fourth row of a four-token call?"""
    probe = binding.probe
    x = torch.randn(1, 4, probe.d_in, generator=torch.Generator().manual_seed(46))
    try:
        module = bind_context(binding(probe).eval(), plan, probe)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = module(x)
            module.reset_cache()
            module(x[:, :3], use_cache=True)
            kept = module._attnbench_cache
            step = module(x[:, 3:], use_cache=True)
    except Exception:  # noqa: BLE001 - it does not run so: not a cache
        return False
    if kept is None or not all(isinstance(t, torch.Tensor) for t in (whole, step)) or step.shape[1:2] != (1,):
        return False
    return bool(torch.allclose(step[:, 0], whole[:, 3], rtol=1e-4, atol=1e-5 * float(whole.abs().max())))


def only_cache(binding) -> ContextPlan | None:
    """For a forward whose other parameters no name binds (``forward(x, past_kv=None)``, which
    :func:`~attnbench.plugins.context.plan_for` leaves unplanned): a plan with the cache a probe found, else None."""
    target = binding.target
    try:
        x = list(signatures.signature(target.forward).parameters)[1]
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    if not candidates(target):
        return None
    plan = with_probed_cache(binding, ContextPlan(getattr(target, "__qualname__", repr(target)), x))
    return plan if plan.cache else None
