"""Where is the bug: the first step at which a failing class leaves the reference, named by its source line (issue 47).

For a failing case, :func:`localize_case` builds the class again exactly as the case did (same weights, inputs, dtype
and seed), replays its forward once under a :class:`~attnbench.correctness.localize_record.Recorder`, which keeps
every floating tensor it computes from its input with the line of the class's file that made it, and matches each to
the float64 reference's named stages (:mod:`attnbench.correctness.stages`) up to the layouts real code uses
(:mod:`attnbench.correctness.localize_match`), within the case's tolerance.

The first divergence is the first stage, in the reference's order, that nothing matches while nothing computed from
it matches either (a stage a class fuses away, as SDPA does the scores, is passed over because a later one matches).
Its line is the class's tensor that stands for that stage: one that equals it up to a factor (a wrong or twice-applied
scale) or masks other positions, else the first tensor of the stage's form that the class passes on. When nothing
diverges (every stage up to the output matches: the failure is elsewhere, e.g. a dtype, another call pattern) or
nothing recorded has the stage's form, the line says ``first divergence: cannot tell`` and why; it never names a line
it did not see diverge. A gradient case replays its forward: when the forward matches everywhere, the gradients of
the matched intermediates are compared with the reference's, from the output backwards
(:func:`attnbench.correctness.localize_grad.locate_backward`).

Round 11 refines the line named: a tensor used in another's role where it was made (:mod:`~attnbench.correctness.
localize_roles`), a score scale applied to a later tensor (:mod:`~attnbench.correctness.localize_scale`), a factor
followed back to the tensor it entered at, the class's call of a helper that is right for its other calls
(:mod:`~attnbench.correctness.localize_calls`), queries and keys turned opposite ways by RoPE
(:mod:`~attnbench.correctness.localize_rope`), a forward that returns an earlier stage (no output projection), a
torch call that raises in one dtype (:mod:`~attnbench.correctness.localize_raise`), per-head tensors matched to one
head of a stage (:mod:`~attnbench.correctness.localize_match`); the replays are in
:mod:`~attnbench.correctness.localize_replay`, which case is localised in :mod:`~attnbench.correctness.localize_pick`.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace

import torch

from attnbench.correctness.localize_calls import helper_call
from attnbench.correctness.localize_finding import CHAIN, LAYOUT_OPS, Evidence, Localization, cannot_tell, named
from attnbench.correctness.localize_joined import misjoined
from attnbench.correctness.localize_layout import layout_stage, misordered_merge
from attnbench.correctness.localize_mask import mask_origin, sdpa_flag
from attnbench.correctness.localize_match import MASKED, Fit, best_fit, matches
from attnbench.correctness.localize_norm import foreign_step, norm_step
from attnbench.correctness.localize_parts import wrong_part
from attnbench.correctness.localize_pick import BASELINE_JUDGED, targets
from attnbench.correctness.localize_record import Record
from attnbench.correctness.localize_replay import Replay, replays
from attnbench.correctness.localize_roles import swapped_roles, values_from_other
from attnbench.correctness.localize_rope import discarded, never_rotated, paths_differ, unrotated
from attnbench.correctness.localize_scale import attribute_scale, moved_scale, scaled_chain, sdpa_rescaled
from attnbench.correctness.localize_scale_name import shared_scale
from attnbench.correctness.localize_sdpa_scale import sdpa_scale
from attnbench.correctness.localize_softmax import softmax_step
from attnbench.correctness.localize_span import scale_line
from attnbench.correctness.localize_split_scale import split_scale
from attnbench.correctness.localize_tables import wrong_tables
from attnbench.correctness.localize_unused import unused_mask
from attnbench.correctness.localize_weights import unnormalised
from attnbench.correctness.stages import FUSED, OPTIONAL, ORDER, Stage

__all__ = ["CHAIN", "Localization", "cannot_tell", "locate", "localize_case", "localize_failures", "matches",
           "repro_command"]

ENTRY = {"q": "scores", "k": "scores", "v": "probabilities @ V"}
"""The main-chain stage each projection chain feeds."""


NOT_HOMOGENEOUS = frozenset({"tanh", "softmax", "log_softmax", "exp", "sigmoid", "erf", "gelu", "silu", "relu",
                             "rms_norm", "layer_norm", "normalize", "cos", "sin"})
"""Calls whose output off by a factor says nothing of their input's (a soft-cap's ``tanh(s / C)`` missing its ``C *``)."""

FACTOR_MATCH = 1e-6
"""Two factors within this (relative) are the same factor."""

LOW_PRECISION, LOW_PRECISION_ULPS = ("float16", "bfloat16"), 8
"""In these dtypes a stage matches within at least this many units of roundoff (the case's own tolerance bounds the
output, not each rounded intermediate): a rounding is never named as the bug."""


@dataclass
class Divergence:
    """The first stage nothing matches (``name``) and the record that stands for it, with its fit (to ``as_stage``
    when that is a later stage; ``seen``: the later record it was seen at, this one being where the values first went
    wrong)."""

    name: str
    rec: Record
    fit: Fit
    exact: bool
    as_stage: str | None = None
    seen: Record | None = None


def downstream(name: str, present: list[str]) -> list[str]:
    """The stages of ``present`` computed from stage ``name`` (its chain's later stages, then the main chain's)."""
    pos, chain = ORDER.index(name), CHAIN.get(name)
    later = [s for s in present if ORDER.index(s) > pos]
    if chain is None:
        return later
    entry = ORDER.index(ENTRY[chain])
    return [s for s in later if CHAIN.get(s) == chain or (s not in CHAIN and ORDER.index(s) >= entry)]


def locate(records: list[Record], stages: list[Stage], tol: float, returned: int | None = None,
           returned_at: tuple[str, int, str] | None = None, made=None) -> Localization:
    """The first divergence of ``records`` (one replayed forward) from ``stages`` (the reference's), within ``tol``;
    ``returned``: the index of the record the forward returned, if known, and ``returned_at`` the ``return`` line;
    ``made``: what the forward made from no input (:attr:`~attnbench.correctness.localize_replay.Replay.made`).
    A wrong scale written on a statement's later line is named there (:func:`~.localize_span.scale_line`)."""
    return scale_line(_locate(records, stages, tol, returned, returned_at, made))


def _locate(records: list[Record], stages: list[Stage], tol: float, returned: int | None,
            returned_at: tuple[str, int, str] | None, made) -> Localization:
    if not records:
        return cannot_tell("no intermediate of the class was recorded: its forward made no torch call from its own "
                           "code (compiled, scripted or an extension?)")
    if not stages:
        return cannot_tell("no staged reference for this spec (DeepSeek-style MLA)")
    ev = Evidence(records, stages, tol, *matches(records, stages, tol))
    div = first_divergence(ev)
    if isinstance(div, Localization):
        return div
    if div is None:
        return _missing_steps(ev, returned, returned_at) or _nothing_diverges(ev)
    div = misordered_merge(layout_stage(_normed_before_split(div, ev), ev), ev)
    gain = _gain_factor(div, ev)
    if gain is not None:
        return gain
    for refine in (norm_step, split_scale, softmax_step, misjoined, wrong_part, unused_mask, unnormalised, swapped_roles, values_from_other,
                   shared_scale, moved_scale, scaled_chain, unrotated, paths_differ, never_rotated, discarded):
        found = refine(div, ev)
        if found is not None:
            return found
    found = (mask_origin(div, ev, made) or wrong_tables(div, ev, made) or sdpa_flag(div, ev) or sdpa_rescaled(div, ev)
             or attribute_scale(div, ev, made) or sdpa_scale(div, ev))
    if found is not None:
        return found
    return _named(_factor_origin(div, ev), ev)


def _normed_before_split(div: Divergence, ev: Evidence) -> Divergence:
    """``div`` at ``q heads``/``k heads`` named as the normed stage when the reference norms q and k and the tensor
    found still holds the whole projection ``(b, T, h*d)``: a QK-norm over the whole projection, applied before the
    split (OLMo's), is where such a class leaves the reference, not its split (a wrong split has the heads apart)."""
    side = {"q heads": "q", "k heads": "k"}.get(div.name)
    normed = ev.stage(f"normed {side}") if side else None
    if normed is None or div.rec.value.dim() != 3:
        return div
    return replace(div, name=normed.name)


def _gain_factor(div: Divergence, ev: Evidence) -> Localization | None:
    """At a normed stage, the first record equal to it but for a factor that differs between features and is the
    same at every token (``x * rsqrt(mean(x^2) + eps)`` whose ``* weight`` was left out, or the other side's norm):
    its gain missing or another, named there (or at the call of a norm module right for its other call)."""
    if div.name not in ("normed q", "normed k"):
        return None
    want = ev.stage(div.name).tensor.double()
    for rec in ev.records:
        if rec.index in ev.explained:
            continue
        for w in (want.reshape(*want.shape[:2], -1), want):  # the whole projection (OLMo) or per head
            if tuple(rec.value.shape) != tuple(w.shape):
                continue
            got = rec.value.double()
            ratio = w / torch.where(got.abs() > 1e-12, got, torch.ones_like(got))
            row = ratio[:1, :1]
            if ((ratio - row).abs().max() <= 1e3 * ev.tol and (row - row.flatten()[0]).abs().max() > 1e3 * ev.tol):
                early = foreign_step(div, ev)
                if early is not None and early.index in ev.ancestors(rec.index):
                    return None  # a step of the norm before it is wrong (a sum for the mean): norm_step names it
                return _named(replace(div, rec=rec, seen=None), ev, "off by a factor per feature that is the same at "
                                                                    "every token: the norm's gain is missing or another")
    return None


def _factor_origin(div: Divergence, ev: Evidence) -> Divergence:
    """Where a factor ``div`` is off by entered: the unexplained input of its record that is a stage off by the same
    factor (``k * 2`` under the scores it scales), followed back; ``div`` when none is."""
    fit = div.fit
    if not (div.exact and fit.fit <= ev.tol and math.isfinite(fit.factor) and fit.factor and abs(fit.factor - 1) > ev.tol):
        return div
    if div.rec.op.removeprefix("Tensor.") in NOT_HOMOGENEOUS:
        return div  # tanh(x / C) is not tanh(x) / C: a factor its output is off by did not come from its input
    for i in div.rec.args:
        if i is None or i in ev.sound:
            continue
        rec = ev.records[i]
        for stage in ev.stages:
            alt = best_fit(stage, rec.value, ev.tol, strict=False)
            if (alt is not None and alt.fit <= ev.tol and abs(alt.factor / fit.factor - 1) <= FACTOR_MATCH
                    and stage.name in ORDER):
                return _factor_origin(Divergence(stage.name, rec, alt, True), ev)
    return _moved_from(div, ev)


def _moved_from(div: Divergence, ev: Evidence) -> Divergence:
    """``div`` at the tensor its record only moved (``torch.stack((-x2, x1), -1).flatten(-2)``: the values, sign
    included, were made at the ``stack``, not at the ``flatten``), followed back through calls that only move values."""
    while div.rec.op in LAYOUT_OPS:
        srcs = [ev.records[i] for i in div.rec.args if i is not None and i not in ev.sound]
        if len(srcs) != 1 or srcs[0].value.numel() != div.rec.value.numel():
            break
        div = replace(div, rec=srcs[0])
    return div


def first_divergence(ev: Evidence) -> Divergence | Localization | None:
    """The first stage, in the reference's order, that nothing matches while nothing computed from it matches either,
    and the record that stands for it; ``cannot tell`` when nothing anchors the comparison; ``None`` when none."""
    by_name = {s.name: s for s in ev.stages}
    present = [s.name for s in ev.stages if s.name in ORDER]
    pool = [r for r in ev.records if r.index not in ev.explained]
    for name in present:
        if name in ev.matched or any(d in ev.matched for d in downstream(name, present)):
            continue
        if name == "scores" and "scaled q" in ev.matched:
            continue  # the scale folded into q: the raw scores never exist
        later = [by_name[d] for d in downstream(name, present)]
        div = _candidate(by_name[name], later, _after(name, ev.matched, pool, ev.records), ev)
        if div is None or (name in OPTIONAL and not div.exact):
            continue  # nothing of this stage's form (fused away), or an optional form nothing fits
        if not div.exact and (name in ("q", "k", "v") or not ev.matched):  # a projection off by a vector: its bias
            offset = _bias_offset(ev)
            if offset is not None:
                return offset
        if not ev.matched and not div.exact:  # no anchor at all: a tensor of the stage's form is no evidence of where
            whole = _whole_attention_call(ev)
            if whole is not None:
                return whole
            return cannot_tell("no tensor of the class matches any stage of the reference, not even its projections "
                               "(another split of the heads?): the values cannot say where it diverges")
        return div
    return None


WHOLE_ATTENTION = ("multi_head_attention_forward",)
"""Torch calls that compute a whole attention layer, projections included: nothing before them is the class's own."""


def _whole_attention_call(ev: Evidence) -> Localization | None:
    """The one torch call that computes the whole attention (fairseq's and VALL-E-X's ``F.multi_head_attention_forward``
    with the class's weights), named when nothing of the class matches any stage: what differs is in its arguments."""
    calls = [r for r in ev.records if r.op in WHOLE_ATTENTION]
    if not calls:
        return None
    words = (f"the class computes the whole attention in this one torch call ({calls[0].op}), and its output is "
             "another than the reference's: what differs is in the arguments it is given (heads, masks, add_zero_attn, "
             "bias_k/bias_v, the weights)")
    return named("output", calls[0], words, ev.matched)


def _bias_offset(ev: Evidence) -> Localization | None:
    """A projection off by the same vector at every token (a bias left out, or another bias): the first record
    ``(b, T, features)`` that differs from the q, k, v (or fused) projection by a constant per feature, named."""
    for stage in ev.stages:
        if stage.name not in ("q", "k", "v", FUSED):
            continue
        want = stage.tensor.double().reshape(*stage.tensor.shape[:2], -1)
        size = max(1.0, float(want.abs().max()))
        for rec in ev.records:
            if rec.value.dim() != 3 or tuple(rec.value.shape) != tuple(want.shape):
                continue
            d = rec.value.double() - want
            if d.abs().max() > ev.tol * size and (d - d[:1, :1]).abs().max() <= ev.tol * size:
                words = (f"off by the same vector at every token (|{float(d[0, 0].abs().max()):.2g}| at most): its bias is "
                         "missing or another")
                return named(stage.name if stage.name != FUSED else "q", rec, words, ev.matched)
    return None


def _nothing_diverges(ev: Evidence) -> Localization:
    if "output" in ev.matched:
        return cannot_tell(f"every stage up to the output matches the reference within {ev.tol:.0e}: the failure is "
                           "not in this forward's values")
    return cannot_tell("no tensor of the class has the form of the stage that diverges")


def _missing_steps(ev: Evidence, returned: int | None, returned_at: tuple[str, int, str] | None = None) -> Localization | None:
    """The forward returns a tensor equal to an earlier stage of the main chain (the merged heads: no output
    projection): named at the ``return`` that returned it (``returned_at``; else the line that computed it), as the
    first stage after that one."""
    if returned is None or "output" in ev.matched or returned not in ev.explained:
        return None
    equal = [n for n in ev.explained[returned] if n in ORDER and n not in CHAIN]
    if not equal:
        return None
    last = max(equal, key=ORDER.index)
    nxt = next(s.name for s in ev.stages if s.name in ORDER and ORDER.index(s.name) > ORDER.index(last))
    rec = ev.records[returned]
    words = f"the class returns the reference's {last}: the steps from {last} to the output are missing"
    if rec.line != ev.matched[last].line and rec.op in LAYOUT_OPS | {"dropout"} and rec.caller is None:
        words += " (this line passes it on unchanged)"  # ``y = self.resid_dropout(y)``, the projection left out of it
    elif returned_at is not None and (returned_at[0], returned_at[1]) != (rec.path, rec.line):
        rec = replace(rec, path=returned_at[0], line=returned_at[1], text=returned_at[2], caller=None)
    return named(nxt, rec, words, {k: v for k, v in ev.matched.items() if ORDER.index(k) < ORDER.index(nxt)})


def _named(div: Divergence, ev: Evidence, words: str | None = None) -> Localization:
    """The line for ``div``: at its record, or at the class's call of the helper it is in when that helper gives a
    stage for another call (:func:`~attnbench.correctness.localize_calls.helper_call`); ``words``: what is wrong
    (default: its fit's)."""
    words = div.fit.words(ev.tol) if words is None else words
    other = helper_call(div.rec, ev)
    if div.seen is not None and other is None and div.seen.where != div.rec.where:
        words += f" (seen at {div.seen.where}, computed from this line)"
    elif div.as_stage:
        words += f" as {div.as_stage}"
    if other is None:
        return named(div.name, div.rec, words, ev.matched)
    words += (f" (its helper {div.rec.caller[3]}() at {div.rec.where} \"{div.rec.text}\" gives the reference's "
              f"{ev.explained[other.index][0]} when called at {other.called_at}: the call differs)")
    return named(div.name, div.rec, words, ev.matched, call_site=True)


def _candidate(stage: Stage, later: list[Stage], pool: list[Record], ev: Evidence) -> Divergence | None:
    """The unexplained record that stands for ``stage``: the first equal to it or to a later stage up to a factor
    (or that masks other positions than the masked scores: named as those), ``exact``; else the first of its form computed from sound
    records only (where the values first go wrong), else the first of its form, traced back to where it went wrong;
    ``None`` when no record has its form."""
    compatible = []
    for rec in pool:
        fit = best_fit(stage, rec.value, ev.tol, strict=False)
        if fit is None:
            continue
        compatible.append((rec, fit))
        if fit.fit > ev.tol and fit.masks and stage.name == "masked scores":
            again = _as_earlier(rec, stage, ev, latest=True)  # not masked yet: an earlier stage scaled again
            return Divergence(stage.name, rec, fit, True) if again is None else Divergence(again[1], rec, again[0], True)
        if fit.fit <= ev.tol:
            return Divergence(stage.name, rec, fit, True)
        for other in later:
            alt = best_fit(other, rec.value, ev.tol, strict=False)
            if alt is not None and alt.fit <= ev.tol:
                return Divergence(stage.name, rec, alt, True, other.name)
            if alt is not None and alt.masks and other.name == "masked scores" and bool((rec.value <= MASKED).any()):
                return Divergence(other.name, rec, alt, True)  # masked (before the scale), at other positions
    sound, rest = set(ev.sound), []
    for rec, fit in compatible:
        if _softmax_neutral(rec, ev, sound):
            sound.add(rec.index)  # a stable softmax's own steps: right for what comes after them
        else:
            rest.append((rec, fit))
    for rec, fit in rest:
        if set(rec.inputs) <= sound:
            earlier = _as_earlier(rec, stage, ev)
            return Divergence(stage.name, rec, fit, False) if earlier is None else Divergence(
                stage.name, rec, earlier[0], False, earlier[1])
    if not rest:
        return None
    rec, fit = rest[0]
    root = _root(rec, {r.index: r for r in ev.records if r.index not in ev.explained}, sound)
    return Divergence(stage.name, root, fit, False, seen=None if root is rec else rec)


def _softmax_neutral(rec: Record, ev: Evidence, sound: set[int]) -> bool:
    """Whether ``rec`` is a step of a softmax written out that changes nothing its normalisation does not undo: the
    scores less a constant per row (``s - s.amax(-1)``), or the exponential of such (``exp``) when a later record
    divides it (the normalisation, checked itself)."""
    op = rec.op.removeprefix("Tensor.").removeprefix("torch.")
    ins = [ev.records[i] for i in rec.inputs if i in sound]
    if op in ("exp", "exp_"):
        return set(rec.inputs) <= sound and any(rec.index in r.inputs and "div" in r.op
                                                 for r in ev.records[rec.index + 1:])
    if op not in ("sub", "__sub__", "sub_", "__isub__"):
        return False
    for s in ins:
        scores = ev.explained.get(s.index, ())
        if not any(n in ("scores", "scaled scores", "capped scores", "masked scores") for n in scores):
            continue
        if s.value.shape != rec.value.shape:
            continue
        kept = s.value.double() > MASKED
        d = (rec.value.double() - s.value.double()).masked_fill(~kept, 0.0)
        lo = d.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
        hi = d.masked_fill(~kept, float("-inf")).amax(-1, keepdim=True)
        spread = (hi - lo).masked_fill(~kept.any(-1, keepdim=True), 0.0)
        size = float(s.value.double().masked_fill(~kept, 0.0).abs().max())  # the kept scores' (masked: -inf)
        return bool((spread.abs() <= ev.tol * max(1.0, size)).all())
    return False


def _as_earlier(rec: Record, stage: Stage, ev: Evidence, latest: bool = False) -> tuple[Fit, str] | None:
    """``(fit, name)`` when ``rec`` is an earlier stage of the main chain up to a factor (a scale applied twice:
    the masked scores scaled again where the probabilities were expected; with ``latest``, the latest such stage:
    scaled scores scaled again where the masked scores were expected), else ``None``."""
    for other in (reversed(ev.stages) if latest else ev.stages):
        if other.name in ORDER and other.name not in CHAIN and ORDER.index(other.name) < ORDER.index(stage.name):
            fit = best_fit(other, rec.value, ev.tol, strict=False)
            if fit is not None and fit.fit <= ev.tol and abs(fit.factor - 1) > ev.tol:
                return fit, other.name
    return None


def _after(name: str, matched: dict[str, Record], pool: list[Record], records: list[Record]) -> list[Record]:
    """The unexplained records computed from what matched before stage ``name`` on its chain (the main chain: its
    matched stages, else every matched stage); all of ``pool`` when none matched."""
    chain = CHAIN.get(name)
    before = [s for s in ORDER[:ORDER.index(name)] if s in matched and CHAIN.get(s) == chain]
    anchors = {matched[s].index for s in (before or [s for s in ORDER[:ORDER.index(name)] if s in matched])}
    if not anchors:
        return pool
    reached = set(anchors)
    for rec in records:
        if reached & set(rec.inputs):
            reached.add(rec.index)
    return [r for r in pool if r.index in reached] or ([] if before else pool)


def _root(rec: Record, by_index: dict[int, Record], sound: set[int]) -> Record:
    """The earliest record ``rec`` was computed from that is not sound while its own inputs are (where the values
    first went wrong), or ``rec``."""
    todo, roots, seen = [rec], [], set()
    while todo:
        r = todo.pop()
        if r.index in seen:
            continue
        seen.add(r.index)
        parents = [by_index[i] for i in r.inputs if i not in sound and i in by_index]
        if not parents and set(r.inputs) <= sound:
            roots.append(r)
        todo += parents
    return min(roots, key=lambda r: r.index) if roots else rec


def localize_case(impl, case, device: str = "cpu", seed: int = 0, tol: float | None = None) -> Localization:
    """Where ``case`` of ``impl`` (an Implementation or a name) first leaves the reference (see the module's doc);
    ``tol``: the case's tolerance (default: :data:`~attnbench.correctness.cases.TOLERANCE` of its dtype)."""
    from attnbench import registry
    from attnbench.correctness.cases import TOLERANCE

    impl = registry.get(impl) if isinstance(impl, str) else impl
    tol = TOLERANCE.get(case.dtype, 1e-5) if tol is None or not tol == tol else tol
    if case.dtype in LOW_PRECISION:  # each intermediate rounded to the dtype is a few units of roundoff off by itself
        tol = max(tol, LOW_PRECISION_ULPS * torch.finfo(getattr(torch, case.dtype)).eps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if case.kind == "decode":
            from attnbench.correctness.localize_decode import decode_finding

            found = decode_finding(impl, case, device, seed, tol, lambda r, st, ret, made: locate(r, st, tol, ret,
                                                                                                   made=made))
            if found is not None:
                return found
        if case.kind == "eval_deterministic":
            from attnbench.correctness.localize_random import random_in_eval

            found = random_in_eval(impl, case, device, seed)
            if found is not None:
                return found
        found = None
        for rp in replays(impl, case, device, seed, grad=case.kind == "backward"):
            found = _localize_replay(rp, case, tol)
            if found.stage is not None:
                break
    except Exception as exc:  # the replay itself failed: nothing seen, nothing named
        return cannot_tell(f"the replay raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        torch.set_num_threads(threads)
    if case.kind == "backward" and found.stage is None and found.line.endswith("forward's values)"):
        return cannot_tell("backward case: its forward, replayed, and the gradients of every tensor of it equal to a "
                           "stage match the reference")
    if case.kind != "forward" and found.stage is None and found.line.endswith("forward's values)"):
        return cannot_tell(f"{case.kind} case: its forward, replayed, matches the reference at every stage")
    return found


def _localize_replay(rp: Replay, case, tol: float) -> Localization:
    """The first divergence of one replay: where it raised, else in its values (the stages at +theta when q and k
    turn opposite ways), else in its gradients."""
    from attnbench.correctness.localize_raise import raised
    from attnbench.correctness.localize_rope import opposite_turns, other_form

    if rp.error is not None:
        found = raised(rp, case.dtype, tol)
        if found is None:
            raise rp.error
        return found
    turned = opposite_turns(rp.records, rp.stages, rp.plus_theta, tol)
    stages = rp.stages if turned is None else rp.plus_theta
    found = locate(rp.records, stages, tol, rp.returned, rp.returned_at, rp.made)
    if turned is not None and found.stage in ("rotated q", "rotated k"):
        found = turned(found)
    elif turned is None:
        found = other_form(rp.records, found, stages, rp.conventions, tol,
                           lambda alt: locate(rp.records, alt, tol, rp.returned, rp.returned_at, rp.made)) or found
    if rp.backward is not None and found.stage is None and found.line.endswith("forward's values)"):
        found = _backward_finding(rp.records, stages, rp.backward, tol) or found
    return found


def _backward_finding(records, stages, backward, tol: float) -> Localization | None:
    """The first divergence of the gradients (the forward matched everywhere), or ``None``."""
    from attnbench.correctness.localize_grad import locate_backward

    found = locate_backward(records, stages, backward[2], backward[0], backward[1], tol)
    if found is None:
        return None
    name, rec, fit, after, own = found
    words = f"its gradient {fit.words(tol)}, " + ("made by this line of its autograd.Function's backward" if own else
                                                   "in the backward of this line")
    line = (f'first divergence: {name} at {rec.where} "{rec.text}": {words}; the forward matches at every stage and '
            f"the gradients back to {after}")
    return Localization(line, name, rec.path, rec.line, rec.text, words, after, rec.where)


def repro_command(impl_name: str, case, seed: int = 0, device: str = "cpu") -> str:
    """The one-line command that reruns only ``case`` (its kind, shape, dtype and seed): ``attnbench check IMPL
    --kind KIND --shape SHAPE --dtype DTYPE --seed SEED`` (and ``--device`` when not the CPU)."""
    parts = ["attnbench", "check", impl_name, "--kind", case.kind, "--shape", case.shape.id, "--dtype", case.dtype,
             "--seed", str(seed)]
    if device != "cpu":
        parts += ["--device", device]
    return shlex.join(parts)


def localize_failures(results, seed: int = 0, device: str = "cpu", spelled: dict | None = None) -> dict[int, dict]:
    """For ``results`` (:func:`~attnbench.correctness.matrix.run_matrix`'s rows): row index -> ``{"rerun": command}``
    for every failing or erroring case, plus ``"localization"`` (:meth:`Localization.to_json`) for one failing case
    per implementation and kind (:func:`~attnbench.correctness.localize_pick.targets`): a passing check localises nothing.
    ``spelled``: implementation name -> as given on the command line (its rerun command names it so)."""
    from attnbench.correctness.matrix import cases

    bad = results[results.status.isin(["fail", "error"])]
    if bad.empty:
        return {}
    known = {(c.kind, c.shape.id, c.dtype): c for c in cases()}
    out: dict[int, dict] = {}
    for i, r in zip(bad.index, bad.itertuples(), strict=True):
        case = known.get((r.kind, r.shape, r.dtype))
        name = (spelled or {}).get(r.impl, r.impl)
        out[i] = {"rerun": repro_command(name, case, seed, device) if case else
                  shlex.join(["attnbench", "check", name, "--kind", r.kind, "--dtype", r.dtype, "--seed", str(seed)])}
    for i, erred in targets(bad, known):
        case = known[(bad.at[i, "kind"], bad.at[i, "shape"], bad.at[i, "dtype"])]
        loc = _localize_row(bad.loc[i], case, seed, device, spelled)
        if not erred or (loc.detail or "").startswith("raises "):  # an error: only where a torch call of it raised
            out[i]["localization"] = loc.to_json()
    return out


def _localize_row(row, case, seed: int, device: str, spelled: dict | None) -> Localization:
    """:func:`localize_case` for one row of the results (its implementation looked up again as given)."""
    from attnbench import registry

    tol = row["tolerance"] if case.kind not in BASELINE_JUDGED else None
    try:
        impl = registry.get((spelled or {}).get(row["impl"], row["impl"]))  # "SHORT=file.py:Class": as given
    except Exception as exc:  # nothing replayed, nothing named
        return cannot_tell(f"{type(exc).__name__} when looking {row['impl']} up again")
    return localize_case(impl, case, device, seed, float(tol) if tol is not None else None)
