"""The first true cause: a user's class is taken through its stages in order, and a refusal names the first that failed.

import (:mod:`attnbench.plugins.loading`) -> binding (:func:`~attnbench.plugins.binding.bind`, roles by probes) ->
**construction** -> **dtype** -> forward context (mask, tables, positions, cache: :mod:`attnbench.plugins.context`) ->
**causality** -> cases. A later symptom ("not causal with any mask form") is said only when every earlier stage
succeeded: a constructor that raises at every probe size is refused here with the call tried and what it raised; a
class whose weights are built in another dtype than the default's (``nn.Linear(..., dtype=torch.bfloat16)`` through a
class attribute, ``.half()`` in ``__init__``) is cast as a whole, and ``-v`` says so; a class that is causal only with a
boolean constructor flag flipped (``causal=False`` by default, under any name) gets the flag set by the spec's
causality, decided by the behaviour it causes.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.plugins.binding import Binding
from attnbench.plugins.roles import whole_block
from attnbench.plugins.signatures import signature
from attnbench.spec import AttnSpec

ROOMY = AttnSpec(d_in=64, d_out=64, context_length=16, dropout=0.0, num_heads=4, rope_theta=10000.0)
"""A second size for the construction stage: powers of two, a head dim of 16 (some classes refuse 24 wide, 4 heads)."""
ADAPT_HINT = "`attnbench adapt FILE:Class` writes a small adapter with a TODO for what attnbench could not solve"


class ConstructionError(PluginLoadError):
    """The class's constructor raised at every probe size: the first true cause, raised again when it is built, never
    followed by a later stage's symptom."""


def raising_factory(binding: Binding, exc: ConstructionError):
    """A factory that raises ``exc`` when built: resolving the class does not fail (a run records its cells' errors;
    ``check`` reports it once, before any case), and no later probe runs on a class that cannot be built."""

    def factory(spec: AttnSpec):
        raise PluginLoadError(str(exc)) from None

    factory.evidence, factory.imported, factory.binding = [], "", binding
    return factory


def _name(binding: Binding) -> str:
    return getattr(binding.target, "__qualname__", repr(binding.target))


def construct(binding: Binding, probe: AttnSpec, environment_cause) -> Binding:
    """``binding`` once its class is known to build here (else one :class:`PluginLoadError`: the environment it needs,
    or the call tried and what it raised at both sizes), cast as a whole when its weights come out in another dtype."""
    built, failures = None, []
    for spec in (replace(probe, rope_theta=10000.0), ROOMY):
        try:
            built = binding(spec)
            break
        except Exception as exc:
            cause = environment_cause(exc)
            if cause is not None:
                raise PluginLoadError(f"{_name(binding)} cannot be built on this machine: {cause}; run it where that is "
                                      "available, or point --impl at a factory that builds it for one process on this "
                                      "device") from None
            failures.append(f"{type(exc).__name__}: {_first_line(exc)}")
    if built is None:
        raise ConstructionError(f"{_name(binding)} cannot be built: {binding.describe()} raised {failures[0]} (and at "
                              f"d_model 64, 4 heads: {failures[-1]}); {ADAPT_HINT}") from None
    block = whole_block(built, spec)
    if block is not None:
        raise PluginLoadError(f"{_name(binding)} is a whole block, not an attention layer: {block}; check the attention class "
                              "itself (FILE:Class)")
    return with_dtype(binding, built)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:200]


def with_dtype(binding: Binding, module) -> Binding:
    """``binding`` cast as a whole when ``module`` (built by it under the default dtype) holds floating weights of
    another dtype only: the class chose a dtype for itself, and the cases give their own."""
    if not isinstance(module, nn.Module):
        return binding
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    default = torch.get_default_dtype()
    if not dtypes or dtypes == {default} or binding.cast:
        return binding
    built = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    note = f"its weights are built in {built}: cast as a whole to the case's dtype before probing and checking"
    return replace(binding, cast=built, notes=(*binding.notes, note))


def bool_flags(binding: Binding) -> list[tuple[str, bool]]:
    """The constructor's unbound boolean parameters with a default: ``(name, default)``, candidates for a causal flag."""
    try:
        params = signature(binding.target).parameters.values()
    except (TypeError, ValueError):
        return []
    bound = {p for p, _ in binding.params} | {p for p, _ in binding.extras} | {p for p, _ in binding.causal_flags}
    return [(p.name, p.default) for p in params if isinstance(p.default, bool) and p.name not in bound
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def causal_by_flag(binding: Binding, is_causal) -> Binding | None:
    """``binding`` with a constructor flag that makes the class causal (its default does not): each unbound boolean
    flipped in turn, kept when ``is_causal(candidate)`` says the outputs became causal; None when no flag does."""
    if not inspect.isclass(binding.target):
        return None
    for name, default in bool_flags(binding):
        candidate = replace(binding, causal_flags=(*binding.causal_flags, (name, not default)),
                            notes=(*binding.notes, f"{name}: set to {not default} for causal attention and {default} "
                                                   "otherwise, decided by a probe (with its default the outputs are "
                                                   "not causal, flipped they are)"))
        try:
            if is_causal(candidate):
                return candidate
        except Exception:  # this flag breaks the class: not the one
            continue
    return None


def forward_is_causal(binding: Binding, spec: AttnSpec) -> bool:
    """Does a ``forward(x)`` class built by ``binding`` at ``spec`` give causal outputs (changing the last of 5 tokens
    changes only the last output)?"""
    module = binding(spec).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, spec.d_in, generator=g)
    y = x.clone()
    y[:, -1] += torch.randn(spec.d_in, generator=g)
    with torch.no_grad():
        a, b = (module(t) for t in (x, y))
    a, b = (t[0] if isinstance(t, tuple) else t for t in (a, b))
    diff = (a - b).abs().amax(dim=(0, 2))
    scale = a.abs().max().clamp_min(1e-6)
    return bool((diff[:-1] <= 1e-5 * scale).all() and diff[-1] > 1e-3 * scale)
