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
"""

from __future__ import annotations

import shlex
import warnings
from dataclasses import asdict, dataclass

import torch

from attnbench.correctness.localize_match import Fit, best_fit
from attnbench.correctness.localize_record import Record, Recorder
from attnbench.correctness.stages import FUSED, OPTIONAL, ORDER, Stage, capture, staged

CHAIN = {"q": "q", "q heads": "q", "normed q": "q", "rotated q": "q", "scaled q": "q",
         "k": "k", "k heads": "k", "normed k": "k", "rotated k": "k", "v": "v", "v heads": "v"}
"""The projection chains; every other stage is on the main chain (scores to output)."""
ENTRY = {"q": "scores", "k": "scores", "v": "probabilities @ V"}
"""The main-chain stage each projection chain feeds."""


LOW_PRECISION, LOW_PRECISION_ULPS = ("float16", "bfloat16"), 8
"""In these dtypes a stage matches within at least this many units of roundoff (the case's own tolerance bounds the
output, not each rounded intermediate): a rounding is never named as the bug."""


@dataclass
class Localization:
    """Where a failing case first leaves the reference: ``line`` is what ``check`` prints (``first divergence: ...``);
    the other fields are the same facts for ``check --json`` (``None`` where they do not apply)."""

    line: str
    stage: str | None = None
    path: str | None = None
    lineno: int | None = None
    code: str | None = None
    detail: str | None = None
    matched_stage: str | None = None
    matched_at: str | None = None
    called_at: str | None = None
    called_code: str | None = None

    def to_json(self) -> dict:
        """The fields as plain JSON values (``attnbench/schemas/check.schema.json``, ``localization``)."""
        return asdict(self)


def cannot_tell(why: str) -> Localization:
    """``first divergence: cannot tell (why)``."""
    return Localization(f"first divergence: cannot tell ({why})")


def downstream(name: str, present: list[str]) -> list[str]:
    """The stages of ``present`` computed from stage ``name`` (its chain's later stages, then the main chain's)."""
    pos, chain = ORDER.index(name), CHAIN.get(name)
    later = [s for s in present if ORDER.index(s) > pos]
    if chain is None:
        return later
    entry = ORDER.index(ENTRY[chain])
    return [s for s in later if CHAIN.get(s) == chain or (s not in CHAIN and ORDER.index(s) >= entry)]


def matches(records: list[Record], stages: list[Stage], tol: float) -> tuple[dict[str, Record], set[int]]:
    """Stage name -> the first record equal to it within ``tol`` (a fused ``q, k, v`` counts for each; the output only
    when nothing unexplained follows it), and the indices of every record that equals some stage (the explained
    ones)."""
    matched: dict[str, Record] = {}
    explained: set[int] = set()
    for rec in records:
        for stage in stages:
            fit = best_fit(stage, rec.value, tol)
            if fit is not None and fit.error <= tol:
                explained.add(rec.index)
                for name in (("q", "k", "v") if stage.name == FUSED else (stage.name,)):
                    matched.setdefault(name, rec)
    out = matched.get("output")
    if out is not None and any(r.index > out.index and r.index not in explained for r in records):
        del matched["output"]  # the class went on computing from its output: what it returns is a later tensor
    return matched, explained


def locate(records: list[Record], stages: list[Stage], tol: float) -> Localization:
    """The first divergence of ``records`` (one replayed forward) from ``stages`` (the reference's), within ``tol``."""
    if not records:
        return cannot_tell("no intermediate of the class was recorded: its forward made no torch call from its own "
                           "code (compiled, scripted or an extension?)")
    if not stages:
        return cannot_tell("no staged reference for this spec (DeepSeek-style MLA)")
    matched, explained = matches(records, stages, tol)
    by_name = {s.name: s for s in stages}
    present = [s.name for s in stages if s.name in ORDER]
    pool = [r for r in records if r.index not in explained]
    for name in present:
        if name in matched or any(d in matched for d in downstream(name, present)):
            continue
        if name == "scores" and "scaled q" in matched:
            continue  # the scale folded into q: the raw scores never exist
        later = [by_name[d] for d in downstream(name, present)]
        found = _candidate(by_name[name], later, _after(name, matched, pool, records), explained, tol)
        if found is None or (name in OPTIONAL and not found[2]):
            continue  # nothing of this stage's form (fused away), or an optional form nothing fits
        if not matched and not found[2]:  # no anchor at all: a tensor of the stage's form is no evidence of where
            return cannot_tell("no tensor of the class matches any stage of the reference, not even its projections "
                               "(per-head modules, or another split of the heads?): the values cannot say where it "
                               "diverges")
        return _finding(name, found, matched, tol)
    if "output" in matched:
        return cannot_tell(f"every stage up to the output matches the reference within {tol:.0e}: the failure is not "
                           "in this forward's values")
    return cannot_tell("no tensor of the class has the form of the stage that diverges")


def _candidate(stage: Stage, later: list[Stage], pool: list[Record], explained: set[int], tol: float):
    """``(record, fit, exact, as_stage)``: the unexplained record that stands for ``stage``: the first equal to it or
    to a later stage up to a factor (or, for the masked scores, masked differently) with ``exact`` True (``as_stage``:
    the later stage it fits, else ``None``); else the first of its form computed from explained records only (where
    the values first go wrong), else the first of its form; ``None`` when no record has its form."""
    compatible = []
    for rec in pool:
        fit = best_fit(stage, rec.value, tol, strict=False)
        if fit is None:
            continue
        compatible.append((rec, fit))
        if fit.fit <= tol or (fit.masks and stage.name == "masked scores"):
            return rec, fit, True, None
        for other in later:
            alt = best_fit(other, rec.value, tol, strict=False)
            if alt is not None and alt.fit <= tol:
                return rec, alt, True, other.name
    for rec, fit in compatible:
        if set(rec.inputs) <= explained:
            return rec, fit, False, None
    if not compatible:
        return None
    rec, fit = compatible[0]
    root = _root(rec, {r.index: r for r in pool}, explained)
    return (rec, fit, False, None) if root is rec else (root, fit, False, f"seen at {rec.where}")


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
    return [r for r in pool if r.index in reached] or pool


def _root(rec: Record, by_index: dict[int, Record], explained: set[int]) -> Record:
    """The earliest unexplained record ``rec`` was computed from whose own inputs are all explained (where the values
    first went wrong), or ``rec``."""
    todo, roots, seen = [rec], [], set()
    while todo:
        r = todo.pop()
        if r.index in seen:
            continue
        seen.add(r.index)
        parents = [by_index[i] for i in r.inputs if i not in explained and i in by_index]
        if not parents and set(r.inputs) <= explained:
            roots.append(r)
        todo += parents
    return min(roots, key=lambda r: r.index) if roots else rec


def _finding(name: str, found: tuple[Record, Fit, bool, str | None], matched: dict[str, Record], tol: float) -> Localization:
    """The ``first divergence:`` line for stage ``name`` at ``found``'s record, and what matched before it."""
    rec, fit, _, as_stage = found
    before = [s for s in ORDER[:ORDER.index(name)] if s in matched]
    seen = as_stage and as_stage.startswith("seen at ")
    words = fit.words(tol) + (f" ({as_stage}, computed from this line)" if seen else f" as {as_stage}" if as_stage else "")
    line = f'first divergence: {name} at {rec.where} "{rec.text}"'
    if rec.caller is not None:  # a line in a helper: where the class called it, which may be the wrong line
        line += f' (in {rec.caller[3]}(), called at {rec.called_at} "{rec.caller[2]}")'
    line += f": {words}"
    if before:
        last = matched[before[-1]]
        qkv = [s for s in ("q", "k", "v") if s in matched]
        tail = before[-1] if before[-1] not in ("q", "k", "v") else None
        names = ", ".join(qkv) + (f" and {tail}" if qkv and tail else tail or "")
        line += f"; {names} match{'es' * (len(qkv) + bool(tail) == 1)} up to {last.where}"
        at = last.where
    else:
        line += "; nothing matches before it"
        at = None
    return Localization(line, name, rec.path, rec.line, rec.text, words, before[-1] if before else None, at,
                        rec.called_at, rec.caller[2] if rec.caller is not None else None)


def replay(impl, case, device: str = "cpu", seed: int = 0, grad: bool = False):
    """The case's forward replayed under a :class:`Recorder` (built as the case builds it: same weights, inputs,
    dtype, seed) and the reference's stages for the same rounded inputs and weights: ``(records, stages, backward)``,
    ``backward`` ``None`` unless ``grad``, else what :func:`~attnbench.correctness.localize_grad.locate_backward`
    takes: the class's output, the output gradient of the ``backward`` case, the reference stages' gradients."""
    from attnbench.correctness.basic import build_for
    from attnbench.correctness.cases import SEED, inputs, reference
    from attnbench.correctness.localize_grad import reference_grads
    from attnbench.devices import DTYPES
    from attnbench.plugins.exits import plugin_exits

    token = SEED.set(seed)
    try:
        with warnings.catch_warnings(), plugin_exits(impl.name), torch.set_grad_enabled(grad):
            warnings.simplefilter("ignore")
            built = build_for(impl, case, torch.device(device))
            x_low = inputs(case.shape).to(DTYPES[case.dtype])
            x_dev = x_low.to(device).requires_grad_(grad)
            with Recorder([x_dev], keep_live=grad) as rec:
                out = built.module(x_dev)
            x64 = x_low.to(torch.float64).requires_grad_(grad)
            with capture(live=grad) as notes:
                ref_out = reference(x64, built.weights.to(dtype=torch.float64), built.spec)
            backward = None
            if grad:
                g = torch.randn(*ref_out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
                backward = out, g.to(device=out.device, dtype=out.dtype), reference_grads(notes, ref_out, g)
                notes = {k: ({h: t.detach() for h, t in v.items()} if isinstance(v, dict) else v.detach())
                         for k, v in notes.items()}
    finally:
        SEED.reset(token)
    return rec.records, staged(notes, built.spec), backward


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
        records, stages, backward = replay(impl, case, device, seed, grad=case.kind == "backward")
        found = locate(records, stages, tol)
        if backward is not None and found.stage is None and found.line.endswith("forward's values)"):
            found = _backward_finding(records, stages, backward, tol) or found
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


def _backward_finding(records, stages, backward, tol: float) -> Localization | None:
    """The first divergence of the gradients (the forward matched everywhere), or ``None``."""
    from attnbench.correctness.localize_grad import locate_backward

    found = locate_backward(records, stages, backward[2], backward[0], backward[1], tol)
    if found is None:
        return None
    name, rec, fit, after = found
    words = f"its gradient {fit.words(tol)}, in the backward of this line"
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


DTYPE_RANK = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}
"""Which failing case of a kind is localised: the most precise dtype first (its intermediates are the sharpest)."""


def _degenerate(case) -> bool:
    """A case whose stages cannot be told apart: one or two tokens (one query's weights are all 1, RoPE does nothing
    at position 0, the merged heads equal the values), or one feature per head. Localised only when a kind has no
    other failing case: on an unseen set, 4 of 9 wrong lines came from such cases."""
    if case is None:
        return True
    spec = case.shape.spec
    return case.shape.seq_len < 3 or spec.head_dim < 2


def _pick(rows, known: dict) -> int:
    """The failing row of one kind to localise: not degenerate, then the most precise dtype, then the longest."""
    def key(j):
        case = known.get((rows.at[j, "kind"], rows.at[j, "shape"], rows.at[j, "dtype"]))
        return (_degenerate(case), DTYPE_RANK.get(rows.at[j, "dtype"], 9), -(case.shape.seq_len if case else 0))

    return min(rows.index, key=key)


def localize_failures(results, seed: int = 0, device: str = "cpu", spelled: dict | None = None) -> dict[int, dict]:
    """For ``results`` (:func:`~attnbench.correctness.matrix.run_matrix`'s rows): row index -> ``{"rerun": command}``
    for every failing or erroring case, plus ``"localization"`` (:meth:`Localization.to_json`) for one failing case
    per implementation and kind (the most precise dtype's first): a passing check localises nothing.
    ``spelled``: implementation name -> as given on the command line (its rerun command names it so)."""
    from attnbench import registry
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
    failed = bad[bad.status == "fail"]
    for (impl_name, _kind), rows in failed.groupby(["impl", "kind"], sort=False):
        i = _pick(rows, known)
        case = known.get((rows.at[i, "kind"], rows.at[i, "shape"], rows.at[i, "dtype"]))
        if case is None:
            continue
        tol = rows.at[i, "tolerance"]
        try:
            impl = registry.get((spelled or {}).get(impl_name, impl_name))  # "SHORT=file.py:Class": as given
        except Exception as exc:  # nothing replayed, nothing named
            loc = cannot_tell(f"{type(exc).__name__} when looking {impl_name} up again")
        else:
            loc = localize_case(impl, case, device, seed, float(tol) if tol is not None else None)
        out[i]["localization"] = loc.to_json()
    return out
