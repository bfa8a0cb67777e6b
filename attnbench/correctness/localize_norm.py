"""The step of a QK-norm written out that leaves RMSNorm (issue 47).

A norm written by hand (``variance = x.pow(2).mean(-1, keepdim=True)``, ``x = x * torch.rsqrt(variance + eps)``,
``return x * self.weight``) makes several tensors on its way to the normed stage, and only the last is a stage. When
the normed stage matches nothing, the first tensor of the norm's own that matches nothing is the candidate its shape
gives: ``x.pow(2)``, right, one line before a wrong ``torch.sqrt``. :func:`norm_step` checks each step the norm takes
from the sound keys (or queries) against RMSNorm's own steps (``x``, ``x²``, its mean, that plus an ``eps``, its
inverse root, ``x`` times that) and names the first step, made from steps that are right, that is none of them.
"""

from __future__ import annotations

import torch

from attnbench.correctness.localize_finding import CHAIN, Evidence, Localization, first_foreign_step, named

EPS_MAX = 1e-2
"""The largest ``eps`` a norm adds to its mean square."""


def _steps(x: torch.Tensor) -> dict[str, torch.Tensor]:
    sq = x * x
    ms = sq.mean(-1, keepdim=True)
    return {"x": x, "x²": sq, "mean(x²)": ms}


def _which(value: torch.Tensor, steps: dict[str, torch.Tensor], tol: float) -> str | None:
    """The RMSNorm step ``value`` equals (adding to ``steps`` the ones an ``eps`` found here fixes), or ``None``."""
    value = value.double()
    for name, want in list(steps.items()):
        if value.shape == want.shape and torch.allclose(value, want, rtol=tol, atol=tol):
            return name
    ms = steps["mean(x²)"]
    if value.shape == ms.shape and "eps" not in steps:
        eps = (value - ms).mean()
        if 0 <= float(eps) <= EPS_MAX and torch.allclose(value - ms, eps.expand_as(ms), rtol=tol, atol=tol):
            steps["eps"] = eps
            steps["mean(x²) + eps"] = ms + eps
            steps["rsqrt(mean(x²) + eps)"] = (ms + eps).rsqrt()
            steps["x * rsqrt(mean(x²) + eps)"] = steps["x"] * (ms + eps).rsqrt()
            return "mean(x²) + eps"
    return None


def foreign_step(div, ev: Evidence):
    """At ``normed q``/``normed k``: the record of the norm's first step that matches no step of RMSNorm, made from
    ones that do, or ``None``."""
    side = {"normed q": "q", "normed k": "k"}.get(div.name)
    if side is None:
        return None
    source = [i for i in ev.ancestors(div.rec.index) if i in ev.sound and side in ev.chains(i)]
    if not source:
        return None
    x = ev.records[max(source)]
    steps = _steps(x.value.double())
    return first_foreign_step(ev, x, lambda value: _which(value, steps, ev.tol) is not None)


def norm_step(div, ev: Evidence) -> Localization | None:
    """At ``normed q``/``normed k``: the first step of the norm that matches no step of RMSNorm, made from ones that
    do (see the module's doc); ``None`` when every step matches or one is made from something else."""
    rec = foreign_step(div, ev)
    if rec is None:
        return None
    side = {"normed q": "q", "normed k": "k"}[div.name]
    words = f"the norm's steps match RMSNorm's up to here, and this one is none of them: {div.fit.words(ev.tol)}"
    return named(div.name, rec, words, {n: r for n, r in ev.matched.items() if CHAIN.get(n) != side
                                         or not n.startswith("normed")})
