"""A score scale applied in the wrong place (issue 47).

``softmax(scores) / sqrt(d)`` masks and normalises the scores unscaled: the first tensor where scaled scores were
expected is the unscaled one (at the mask line, off by exactly ``1/scale``). That line is right for what it was given;
the bug is where the scale went. When a later tensor of the class is one of its own inputs times exactly the score
scale, the scale was applied there, and that line is named, at the stage where the scale was missed.

A scale applied twice (``k = k * scale`` above ``q @ k.T * scale``) is seen first at the scores, which are right
for what they were given: when the divergence was computed from a query, key or value tensor that is its stage up to
a factor (and a query scaled by the score scale is a form of its own, ``scaled q``, not this), that tensor's line is
named (:func:`scaled_chain`).
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap
from dataclasses import replace

import torch

from attnbench.correctness.localize_finding import CHAIN, Evidence, Localization, named
from attnbench.correctness.localize_match import best_fit, compare
from attnbench.correctness.localize_record import Record

SLOT = ("scaled scores", "masked scores")
"""The stages at which scores missing their scale are first seen."""

EXACT = 1e-6
"""How close (relative) a factor must be to the score scale to be it."""


def score_scale(ev: Evidence) -> float | None:
    """The reference's score scale: its scaled scores over its scores (``None`` when it has neither)."""
    raw, scaled = ev.stage("scores"), ev.stage("scaled scores")
    if raw is None or scaled is None:
        return None
    factor = compare(scaled.tensor, raw.tensor).factor
    return factor if math.isfinite(factor) and factor > 0 else None


def moved_scale(div, ev: Evidence) -> Localization | None:
    """The line that applies the score scale to a later tensor, when ``div`` is the scores without their scale (see
    the module's doc); ``None`` otherwise, or when no later tensor takes the scale."""
    scale = score_scale(ev)
    if div.name not in SLOT or scale is None or abs(scale - 1) <= EXACT:
        return None
    if not (div.exact and div.fit.fit <= ev.tol and abs(div.fit.factor * scale - 1) <= EXACT):
        return None
    later = [r for r in ev.records[div.rec.index + 1:]
             if r.index not in ev.explained and r.index in ev.descendants(div.rec.index)]
    for rec in later:
        if abs(factor_of(rec, ev) - scale) <= EXACT * scale:
            words = (f"the score scale {scale:.3g} is applied here, to a later tensor: the scores reach "
                     f"{div.rec.where} without it (off by a factor of {div.fit.factor:.3g})")
            return named(div.name, rec, words, ev.matched)
    for rec in later:  # a later tensor scaled by another factor: the scale is both late and wrong
        factor = factor_of(rec, ev)
        if math.isfinite(factor) and abs(factor - 1) > EXACT:
            words = (f"the scores are scaled here, by {factor:.3g}, after {div.rec.where} (off by a factor of "
                     f"{div.fit.factor:.3g}); the score scale is {scale:.3g}")
            return named(div.name, rec, words, ev.matched)
    return _never_scaled(div, ev, scale)


def _never_scaled(div, ev: Evidence, scale: float) -> Localization | None:
    """The product that made the raw scores ``div`` was computed from, when no tensor of the class takes the score
    scale: the scale belongs where the scores are made (``q @ k.T * scale``, the common form), not at the mask line
    that first shows it missing."""
    from attnbench.correctness.localize_roles import PRODUCTS

    raw = ev.matched.get("scores")
    if raw is None or raw.op not in PRODUCTS or "scaled q" in ev.matched or raw.index not in ev.ancestors(div.rec.index):
        return None
    words = (f"the scores made here are never scaled: no tensor of the class takes the score scale {scale:.3g} (they "
             f"reach {div.rec.where} off by a factor of {div.fit.factor:.3g})")
    return named("scaled scores", raw, words, ev.matched)


def factor_of(rec: Record, ev: Evidence) -> float:
    """The constant ``rec`` is its one input on the forward's values times (where both are finite), or nan."""
    if len(rec.args) != 1 or rec.args[0] is None:
        return math.nan
    before = ev.records[rec.args[0]].value
    if before.shape != rec.value.shape:
        return math.nan
    got, was = rec.value.to(torch.float64), before.to(torch.float64)
    keep = torch.isfinite(got) & torch.isfinite(was) & (was != 0)
    if not keep.any():
        return math.nan
    fit = compare(got[keep], was[keep])
    return fit.factor if fit.fit <= max(ev.tol, EXACT) else math.nan


def scaled_chain(div, ev: Evidence) -> Localization | None:
    """The line of a query, key or value tensor that ``div`` was computed from and that is its stage times a factor
    other than 1 (``k * scale`` beside the scores' own scale); ``None`` when there is none."""
    for i in sorted(ev.ancestors(div.rec.index)):
        if i in ev.explained or i == div.rec.index:
            continue
        rec = ev.records[i]
        if _compensated(div, i, ev):
            continue  # q and k each scaled by head_dim ** -0.25 (Whisper, guided-diffusion): the scores come out right
        for stage in ev.stages:
            if stage.name not in CHAIN or stage.name == "scaled q":
                continue
            fit = best_fit(stage, rec.value, ev.tol, strict=False)
            if (fit is not None and fit.fit <= ev.tol and math.isfinite(fit.factor) and fit.factor != 0
                    and abs(fit.factor - 1) > ev.tol):
                words = (f"{fit.words(ev.tol)}: {stage.name} is scaled here, and what {div.rec.where} computes from "
                         f"it is {div.name} {div.fit.words(ev.tol)}")
                return named(stage.name, rec, words, ev.matched)
    return None


def _compensated(div, index: int, ev: Evidence) -> bool:
    """Whether a stage the reference reaches after scaling (its scaled or masked scores, its probabilities) is matched
    by a tensor made from record ``index``, and ``div`` is no factor off: a factor on it was then made up for before it
    mattered (not when the scores are scaled again: ``k / sqrt(d)`` and then the scores' own scale)."""
    factor = div.fit.factor
    if div.exact and math.isfinite(factor) and abs(factor - 1) > EXACT:
        return False
    after = ev.descendants(index)
    return any(ev.matched.get(name) is not None and ev.matched[name].index in after
               for name in ("scaled scores", "masked scores", "probabilities"))


def sdpa_rescaled(div, ev: Evidence) -> Localization | None:
    """Queries scaled by the class (``scaled q`` matched) and then given to ``scaled_dot_product_attention``, which
    scales its scores again by default: the line that scaled the queries is named."""
    scaled = ev.matched.get("scaled q")
    if scaled is None or "scaled_dot_product_attention" not in div.rec.op or scaled.index not in ev.ancestors(div.rec.index):
        return None
    return named("scaled q", scaled, "the queries are scaled here, and scaled_dot_product_attention scales the scores "
                                     f"again (at {div.rec.where}; its default scale is 1/sqrt(head_dim))", ev.matched)


FACTOR_STAGES = ("scaled q", "scaled scores", "masked scores")


def attribute_scale(div, ev: Evidence, made) -> Localization | None:
    """Scores off by a factor at a line that multiplies by a number the class set itself (``* self.scaling``) or
    divides by one (``/ self.norm_factor``, an int too: GPT-NeoX's ``sqrt(head_size)`` planted as ``head_size``), the
    factor being what that number applies over the score scale: the ``__init__`` line that set it (``self.scaling =
    self.hidden_size ** -0.5``) is named."""
    if made is None or div.name not in FACTOR_STAGES or not div.exact or div.fit.fit > ev.tol:
        return None
    if not math.isfinite(div.fit.factor) or abs(div.fit.factor - 1) <= EXACT:
        return None
    module, scale = made[3], score_scale(ev)
    for attr in re.findall(r"self\.(\w+)", div.rec.text):
        value = getattr(module, attr, None)
        divides = re.search(rf"/\s*self\.{attr}\b", div.rec.text) is not None  # GPT-NeoX: scores / self.norm_factor
        if not isinstance(value, float | int) or isinstance(value, bool) or not value or scale is None:
            continue
        if isinstance(value, int) and not divides:  # a scale the class set (an int it multiplies by is a size: d_out)
            continue
        applied = 1 / (value * scale) if divides else value / scale
        if abs(applied - div.fit.factor) <= 1e-6 * abs(div.fit.factor) and _a_size(attr):  # / self.head_dim
            return named(div.name, div.rec, f"the scores are divided here by self.{attr} = {value:.4g}, a size, where "
                                            f"the score scale is {scale:.4g}: {div.fit.words(ev.tol)}", ev.matched)
        if abs(applied - div.fit.factor) <= 1e-6 * abs(div.fit.factor):  # it stands where the scale belongs
            found = _assigned(type(module), attr)
            if found is not None:
                rec = replace(div.rec, path=found[0], line=found[1], text=found[2], caller=None)
                return named(div.name, rec, f"self.{attr} = {getattr(module, attr):.4g} is set here, and the scores "
                                            f"it scales at {div.rec.where} are {div.fit.words(ev.tol)}", ev.matched)
    return None


SIZE_WORDS = frozenset({"dim", "size", "head", "heads", "dk", "model", "embd", "embed", "width", "hidden", "features"})
SCALE_WORDS = frozenset({"scale", "scaling", "factor", "norm", "temperature", "temp", "inv", "softmax"})


def _a_size(attr: str) -> bool:
    """Whether ``self.<attr>`` is named as a size (``head_dim``, ``d_head``, ``head_size``), not as a scale
    (``scaling``, ``norm_factor``): a size the scores are divided by is wrong where it is used, a scale where it is
    set."""
    words = set(attr.lower().strip("_").split("_"))
    return bool(words & SIZE_WORDS) and not words & SCALE_WORDS


def _assigned(cls, attr: str) -> tuple[str, int, str] | None:
    """``(path, line, text)`` of the statement of ``cls`` (or a base of it) that assigns ``self.<attr>``."""
    for klass in cls.__mro__:
        try:
            lines, start = inspect.getsourcelines(klass)
            path = inspect.getsourcefile(klass)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and any(
                    isinstance(t, ast.Attribute) and t.attr == attr and getattr(t.value, "id", "") == "self"
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
                return path, start + node.lineno - 1, lines[node.lineno - 1].strip()
    return None
