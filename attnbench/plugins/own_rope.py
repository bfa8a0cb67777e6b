"""A RoPE that a class always applies with a base nothing it takes sets, measured on the class (issue 46, round 19).

Many classes build their rotary tables in ``__init__`` from the head size alone (``RotaryEmbedding(head_dim)``,
whose ``base=10000`` default no caller changes; Llama 3 ports that write ``theta=500000.0`` into the call). No name
says RoPE, so the class was checked without it and failed every case. Here the class itself says so, by the probe of
:func:`~attnbench.plugins.measured.rope_direction` extended to every pair (:func:`~attnbench.plugins.measured.pair_turn`):

* the token at position 1 holds ``e_a`` in every head and the one at position 0 ``+e_b`` or ``-e_b``, where ``(a, b)``
  is the ``i``-th pair of the measured pairing (half: ``(i, i + head_dim/2)``, interleaved: ``(2i, 2i + 1)``), with
  ``W_q = W_k = W_v = W_o = I``. The two signs' log-odds differ by ``2 s sin(w_i)``, where ``s`` is the score scale and
  ``w_i`` the angle pair ``i`` turns by per position;
* pair 0 turns by one radian at every base, so ``sin(w_i) / sin(1)`` gives ``w_i`` without knowing ``s``, and each
  further pair gives the base: ``w_i = theta ** (-2i / head_dim)``. The pairs must agree (a scaled or learned table
  does not fit one base, and nothing is inferred from it).

The class is then checked with RoPE at that base: a spec without RoPE gets it filled in, one at another base is
skipped as the class's own constraint (:meth:`~attnbench.plugins.layout.PluginFactory.own_spec`).
"""

from __future__ import annotations

import math

import torch

from attnbench.plugins import measured
from attnbench.spec import AttnSpec

ROTARY_WORDS = ("rotat", "rope", "sin(", "cos(", "freq", "theta", "polar")
"""Words whose absence from a class's module spares it the probe (a forward call where the plug-in loads)."""


def may_rotate(obj) -> bool:
    """Whether ``obj``'s module could rotate by position (its source says so, or cannot be read)."""
    return measured.source_mentions(obj, ROTARY_WORDS)


def own_theta(factory, style: str) -> float | None:
    """The base of the RoPE ``factory``'s class applies by itself, pairs ``style``; ``None`` when the pairs fit no one
    base (or the probe cannot run)."""
    hd = measured._HD
    pair = {"half": lambda i: (i, i + hd // 2), "interleaved": lambda i: (2 * i, 2 * i + 1)}[style]
    try:
        probe = measured._Probe(factory, AttnSpec(**measured.PROBE.kwargs()))
        turns = [measured.pair_turn(probe, *pair(i)) for i in range(hd // 2)]
    except Exception:  # does not build or run on the probe: nothing inferred
        return None
    ratios = [t / turns[0] for t in turns[1:]]
    if not all(torch.isfinite(r).all() and (r > 0).all() and (r.max() - r.min()) < 1e-6 for r in ratios):
        return None
    thetas = []
    for i, r in enumerate(ratios, start=1):
        angle = math.asin(min(float(r.mean()) * math.sin(1.0), 1.0))
        if not 0 < angle < 1:
            return None
        thetas.append(angle ** (-hd / (2 * i)))
    if max(thetas) - min(thetas) > 1e-4 * max(thetas):
        return None
    return float(f"{thetas[-1]:.5g}")


def apply_own_rope(factory, caps: dict, declared: dict, obj=None) -> list[str]:
    """Measure a RoPE the class applies with no name saying so; record it on ``factory`` (``requires`` the theta,
    ``own`` its base, pairs and sign) and ``caps``; the ``check -v`` lines."""
    plan = getattr(factory, "context", None)
    if caps.get("rope") or "rope" in declared or (plan is not None and getattr(plan, "tables", None)):
        return []
    if obj is not None and not may_rotate(obj):
        return []
    found = measured.rope_direction(factory)
    style = None if found is None else {measured._HD // 2: "half", 1: "interleaved"}.get(found[1])
    theta = None if style is None else own_theta(factory, style)
    if theta is None:
        return []
    caps["rope"] = (style,)
    factory.requires = (*factory.requires, "rope_theta")
    factory.refuses = tuple(dict.fromkeys((*factory.refuses, "rope_scaling")))
    factory.own.update(rope_theta=theta, rope_style=style, **({"rope_sign": -1} if found[0] < 0 else {}))
    turn = "+theta" if found[0] > 0 else "-theta (the reference turns by -theta too: rope_sign=-1)"
    return [f"rope: {style}, its own, theta {theta:g}, {turn} (nothing the class takes says RoPE; measured: with W_q = W_k = I "
            "each pair of dimensions turns by theta ** (-2i/head_dim) per position, pair 0 by one radian, and every "
            f"pair fits theta {theta:g}): specs without RoPE are checked with it, specs at another theta are skipped"]

