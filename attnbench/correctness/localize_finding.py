"""What localisation found, and the evidence it found it in (issue 47).

:class:`Localization` is the ``first divergence:`` line ``check`` prints and its fields in ``check --json``;
:class:`Evidence` is one replayed forward's records matched to the reference's stages, which the refinements
(:mod:`~attnbench.correctness.localize_roles`, :mod:`~attnbench.correctness.localize_scale`,
:mod:`~attnbench.correctness.localize_calls`) read; :func:`named` writes the line for a stage at a record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from attnbench.correctness.localize_match import has_form
from attnbench.correctness.localize_record import Failure, Record
from attnbench.correctness.stages import ORDER, Stage

CHAIN = {"q": "q", "q heads": "q", "normed q": "q", "q * cos": "q", "rotate(q)": "q", "rotated q": "q", "scaled q": "q",
         "k": "k", "k heads": "k", "normed k": "k", "k * cos": "k", "rotate(k)": "k", "rotated k": "k",
         "v": "v", "v heads": "v"}
"""The projection chains; every other stage is on the main chain (scores to output)."""

LAYOUT_OPS = frozenset({
    "Tensor.view", "Tensor.reshape", "reshape", "Tensor.transpose", "transpose", "Tensor.permute", "permute",
    "Tensor.contiguous", "Tensor.chunk", "chunk", "Tensor.split", "split", "Tensor.unbind", "unbind",
    "Tensor.__getitem__", "Tensor.narrow", "narrow", "Tensor.flatten", "flatten", "Tensor.unflatten", "unflatten",
    "Tensor.unsqueeze", "unsqueeze", "Tensor.squeeze", "squeeze", "Tensor.view_as", "Tensor.expand",
    "Tensor.expand_as", "Tensor.clone", "clone", "Tensor.detach", "detach", "Tensor.t", "Tensor.mT", "Tensor.T",
    "Tensor.movedim", "movedim", "Tensor.swapaxes", "Tensor.repeat_interleave", "repeat_interleave"})
"""Calls that only move values: applied directly to tensors that are right, what they give is right."""


TERMS = {"q * cos": "rotated q", "rotate(q)": "rotated q", "k * cos": "rotated k", "rotate(k)": "rotated k"}
"""The terms of ``q cos + rotate(q) sin``, matched on lines of their own, are named as the rotation they are part of."""


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
        """The fields as plain JSON values (``attnbench/correctness/check.schema.json``, ``localization``)."""
        return asdict(self)


def cannot_tell(why: str) -> Localization:
    """``first divergence: cannot tell (why)``."""
    return Localization(f"first divergence: cannot tell ({why})")


@dataclass
class Evidence:
    """One replayed forward matched to the reference: its ``records``, the ``stages``, the tolerance, stage name ->
    the first record equal to it (``matched``), record index -> the stages it equals (``explained``), and the
    indices of records that are right (``sound``: explained, or a layout call applied directly to sound records)."""

    records: list[Record]
    stages: list[Stage]
    tol: float
    matched: dict[str, Record]
    explained: dict[int, list[str]]
    sound: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        main = {i for i, names in self.explained.items() if any(n in ORDER and n not in CHAIN for n in names)}
        for i in [i for i, names in self.explained.items() if all(n in CHAIN for n in names)]:
            if (self.ancestors(i) - {i}) & main:  # a projection's value made from the scores: by chance (the weights
                del self.explained[i]             # summed away, ``einsum("bhij,bhid->bhid")`` gives v back)
        self.matched = {n: r for n, r in self.matched.items() if r.index in self.explained}
        self.sound = set(self.explained)
        for rec in self.records:
            if (rec.op in LAYOUT_OPS and rec.direct and rec.inputs and set(rec.inputs) <= self.sound
                    and not any(has_form(s, rec.value) for s in self.stages)):
                self.sound.add(rec.index)  # a split of right values into no stage's form (x.chunk(2)): not checkable

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def chains(self, index: int) -> set[str]:
        """The projection chains (``q``, ``k``, ``v``) whose stages record ``index`` equals."""
        return {CHAIN[n] for n in self.explained.get(index, ()) if n in CHAIN}

    def ancestors(self, index: int) -> set[int]:
        """The indices of the records record ``index`` was computed from (directly or not), and itself."""
        todo, seen = [index], set()
        while todo:
            i = todo.pop()
            if i is None or i in seen or i >= len(self.records):
                continue
            seen.add(i)
            todo += list(self.records[i].inputs)
        return seen

    def descendants(self, index: int) -> set[int]:
        """The indices of the records computed (directly or not) from record ``index``, and itself."""
        reached = {index}
        for rec in self.records[index + 1:]:
            if reached & set(rec.inputs):
                reached.add(rec.index)
        return reached


def first_foreign_step(ev: Evidence, start: Record, is_step) -> Record | None:
    """The first record made from ``start`` and records :func:`is_step` accepted (``is_step(value)``: a step of a
    written-out computation, a norm's or a softmax's) that it does not accept; ``None`` when every step is accepted,
    when a step takes what the walk did not make or reaches a stage, or when the very first step is not accepted
    (what the stage's candidate names already)."""
    right = {start.index}
    for rec in ev.records[start.index + 1:]:
        if not set(rec.inputs) & right:
            continue
        if rec.index in ev.explained or not set(rec.inputs) <= right:
            return None
        if is_step(rec.value):
            right.add(rec.index)
        else:
            return rec if len(right) > 1 else None
    return None


def named(name: str, rec: Record | Failure, words: str, matched: dict[str, Record],
          call_site: bool = False) -> Localization:
    """The ``first divergence:`` line for stage ``name`` at ``rec``'s line (a record, or the call that raised;
    ``call_site``: at the line of the class that called the helper ``rec`` is in), with ``words`` (how it differs)
    and what matched before it."""
    if call_site:
        path, lineno, text = rec.caller[:3]
        where, called_at, called_code = rec.called_at, None, None
    else:
        path, lineno, text, where = rec.path, rec.line, rec.text, rec.where
        called_at, called_code = rec.called_at, rec.caller[2] if rec.caller is not None else None
    shown = TERMS.get(name, name)
    line = f'first divergence: {shown} at {where} "{text}"'
    if called_at is not None:  # a line in a helper: where the class called it, which may be the wrong line
        line += f' (in {rec.caller[3]}(), called at {called_at} "{called_code}")'
    line += f": {words}"
    before = [s for s in ORDER[:ORDER.index(name)] if s in matched]
    if before:
        last = matched[before[-1]]
        qkv = [s for s in ("q", "k", "v") if s in matched and s in before]
        tail = before[-1] if before[-1] not in ("q", "k", "v") else None
        names = ", ".join(qkv) + (f" and {tail}" if qkv and tail else tail or "")
        line += f"; {names} match{'es' * (len(qkv) + bool(tail) == 1)} up to {last.where}"
        at = last.where
    else:
        line += "; nothing matches before it"
        at = None
    return Localization(line, shown, path, lineno, text, words, before[-1] if before else None, at, called_at,
                        called_code)
