"""The step of a softmax written out that leaves softmax (issue 47).

``shifted = s - s.amax(dim, keepdim=True)``, ``numer = torch.exp(shifted)``, ``denom = numer.sum(dim, keepdim=True)``,
``return numer / denom``: only the last is a stage (the probabilities). When the probabilities match nothing and
the scores they come from are right, :func:`softmax_step` checks each step made from the scores against a softmax's
own (a shift by one value per row, its row maximum, ``exp`` of a shifted row, a row's sum of those) and names the
first step, made from steps that are right, that is none of them (a sum over the queries, a maximum over the wrong
axis).
"""

from __future__ import annotations

import torch

from attnbench.correctness.localize_finding import Evidence, Localization, first_foreign_step, named

SCORES = ("masked scores", "capped scores", "scaled scores", "scores")
"""The stages a softmax takes, latest first."""


def _row_constant(diff: torch.Tensor, tol: float) -> bool:
    """Whether ``diff`` is the same along the last axis wherever it is finite (and finite in some place of each
    row where the scores are)."""
    finite = torch.isfinite(diff)
    if not finite.any():
        return False
    first = torch.where(finite, diff, float("nan")).nanmean(-1, keepdim=True)
    return bool(torch.allclose(torch.where(finite, diff, first), first.expand_as(diff), rtol=tol, atol=tol * 10))


def _is_step(value: torch.Tensor, x: torch.Tensor, exps: list[torch.Tensor], tol: float) -> str | None:
    """The softmax step ``value`` is, from scores ``x`` (in the class's layout) and the ``exps`` found so far."""
    value = value.double()
    if value.shape == x.shape:
        hidden = torch.isneginf(x)
        if torch.equal(torch.isneginf(value), hidden) and _row_constant(value - x, tol):
            return "shift"
        if bool((value[hidden] == 0).all()) and bool((value >= 0).all()) and _row_constant(value.log() - x, tol):
            exps.append(value)
            return "exp"
        return None
    rowmax = x.amax(-1, keepdim=True)
    for want in [rowmax, *(e.sum(-1, keepdim=True) for e in exps)]:
        for form in (want, want.squeeze(-1)):
            if value.shape == form.shape and torch.allclose(value, form, rtol=tol, atol=tol):
                return "row"
    return None


def softmax_step(div, ev: Evidence) -> Localization | None:
    """At ``probabilities``: the first step of a softmax written out that is no softmax step, made from the right
    scores and steps that are right (see the module's doc); ``None`` when there is none."""
    if div.name != "probabilities":
        return None
    name = next((n for n in SCORES if n in ev.matched), None)
    if name is None:
        return None
    x = ev.matched[name]
    scores, exps = x.value.double(), []
    rec = first_foreign_step(ev, x, lambda value: _is_step(value, scores, exps, ev.tol) is not None)
    if rec is None:
        return None
    words = f"the softmax's steps match a softmax's up to here, and this one is none of them: {div.fit.words(ev.tol)}"
    return named(div.name, rec, words, {n: r for n, r in ev.matched.items() if n != "probabilities"})
