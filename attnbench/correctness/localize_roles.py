"""Keys and values swapped where they are produced (issue 47).

``q, v, k = self.c_attn(x).split(n, dim=2)`` gives a ``k`` equal to the reference's values and a ``v`` equal to its
keys: each matches a stage (the other's), so the first stage nothing matches is the scores, computed from the wrong
tensor. The roles are read off how the class uses its tensors: the key is what the scores take beside the queries
(``q @ k.transpose(-2, -1)``, or the second argument of ``scaled_dot_product_attention``), the value what the
attention weights are applied to. When the key holds the reference's values **and** the value holds its keys, the
two were swapped where they were made: the line named is where the tensor used as the key was first produced (the
split, the unpacking, the projection). A key that holds the values while the values are right (``q @ v.T``) is a
bug at the scores, named there as before. A tensor rotated before the scores is judged by what it was made from
(round 16): keys sliced from the value's slot of a fused projection, then rotated, hold the reference's values.
"""

from __future__ import annotations

import re

from attnbench.correctness.localize_finding import CHAIN, Evidence, Localization, named
from attnbench.correctness.localize_record import Record

FUSED_ATTENTION = ("scaled_dot_product_attention",)
"""Calls that take ``(query, key, value)`` in that order."""

PRODUCTS = frozenset({"matmul", "Tensor.matmul", "Tensor.__matmul__", "bmm", "Tensor.bmm", "einsum", "baddbmm",
                      "Tensor.baddbmm"})
"""Calls that compute the scores (``q @ k.T``) or apply the weights to the values (``p @ v``)."""


def roles(ev: Evidence) -> dict[str, int] | None:
    """Role (``q``, ``k``, ``v``) -> the record the class uses in it, by how it uses them, or ``None``: the first
    product (:data:`PRODUCTS`) of two projection-chain records is the scores (the query first, then the key:
    ``q @ k.T``, ``einsum(..., q, k)``), and the value is what a later product takes beside something computed from
    the scores."""
    scores = _scores_record(ev)
    near = scores is None  # no product of two chain tensors: one of them made from a chain tensor, then
    scores = _scores_record(ev, near) if near else scores
    if scores is None:
        return None
    if scores.op in FUSED_ATTENTION:
        return dict(zip("qkv", scores.args[:3], strict=True))
    found = dict(zip("qk", _fed(scores, ev, near), strict=True))
    later = ev.descendants(scores.index)
    for rec in ev.records[scores.index + 1:]:
        fed = [i for i in _fed(rec, ev, near) if i not in later]
        if rec.op in PRODUCTS and fed and any(i in later for i in rec.inputs):
            found["v"] = fed[0]
            break
    return None if near and len(found) < 3 else found  # read from what they were made of: all three, or none


def _scores_record(ev: Evidence, near: bool = False) -> Record | None:
    """The record of the call that computes the scores (or the whole attention), as :func:`roles` finds it."""
    for rec in ev.records:
        if rec.op in FUSED_ATTENTION and len(rec.args) >= 3 and None not in rec.args[:3]:
            return rec
    return next((r for r in ev.records if r.op in PRODUCTS and len(_fed(r, ev, near)) == 2), None)


_NAME = r"((?:self\.)?[A-Za-z_]\w*)"
OPERANDS = (
    re.compile(rf"scaled_dot_product_attention\(\s*(?:query\s*=\s*)?{_NAME}[^,]*,\s*(?:key\s*=\s*)?{_NAME}"),
    re.compile(rf"einsum\(\s*(?:'[^']*'|\"[^\"]*\")\s*,\s*{_NAME}[^,]*,\s*{_NAME}"),
    re.compile(rf"(?:matmul|bmm)\(\s*{_NAME}[^,]*,\s*{_NAME}"),
    re.compile(rf"{_NAME}\)?\s*@\s*\(?\s*{_NAME}"),
)
"""The first two operands of the scores' call as the line spells them (``q @ k.transpose(-2, -1)``,
``torch.matmul(xq, xk.transpose(2, 3))``, ``einsum("...", q, k)``, ``scaled_dot_product_attention(q, k, v)``)."""


def _named_as(name: str, role: str) -> bool:
    """Whether a variable name reads as ``role`` (``q``: ``q``, ``xq``, ``query``, ``q_rot``, ``queries``, ...)."""
    word = {"q": "query", "k": "key"}[role]
    name = name.lower().rsplit(".", 1)[-1]
    return (name in (role, f"x{role}", f"{role}s") or name.startswith((word, f"{role}_")) or name.endswith(f"_{role}")
            or name == f"{word}s")


def reads_in_order(rec: Record | None) -> bool:
    """Whether the line that computes the scores spells its operands as the queries, then the keys: a swap of the two
    tensors it takes was then made before it (``k, q, v = qkv.chunk(3)``), not by it (``k @ q.transpose``)."""
    if rec is None:
        return False
    for pattern in OPERANDS:
        found = pattern.search(rec.text)
        if found is not None:
            return _named_as(found.group(1), "q") and _named_as(found.group(2), "k")
    return False


def _fed(rec: Record, ev: Evidence, near: bool = False) -> list[int]:
    """The records of a projection chain ``rec`` takes, in call order; ``near``: or made from one (a tensor rotated
    from a wrong slot matches no stage, but what it was made from does)."""
    return [i for i in rec.args if i is not None and ev.chains(_nearest_held(ev, i) if near else i)]


def swapped_roles(div, ev: Evidence) -> Localization | None:
    """The line that made a tensor the class uses in another's role (see the module's doc); ``None`` when every role
    holds its own."""
    found = roles(ev) or {}
    for role, index in found.items():
        index = _nearest_held(ev, index)
        held = ev.chains(index)
        if len(held) != 1 or held == {role}:
            continue
        other = next(iter(held))
        owner = found.get(other)
        if ({role, other} == {"q", "k"} and owner is not None and ev.chains(owner) == {role}
                and not reads_in_order(_scores_record(ev))):
            continue  # queries and keys swapped in the scores (k @ q.T): the bug is at the scores
        origin = _origin(ev, index, other)
        if owner is not None and (_origin(ev, owner, other) is origin or _nearest_held(ev, owner) == index):
            continue  # one tensor in two roles (or slices of one: k[:, :, :stop] as values): where it is used is the bug
        stage = next(n for n in ev.explained[origin.index] if CHAIN.get(n) == other)
        swapped = owner is not None and ev.chains(owner) == {role}
        words = (f"holds the reference's {stage}" + (f", and the tensor used as {other} holds its {role}" if swapped
                                                       else "") +
                 f" ({f'{role} and {other} swapped' if swapped else f'used as {role}'}; first seen at "
                 f"{div.rec.where}: {div.fit.words(ev.tol)})")
        wrong = {role, other} if swapped else {role}
        matched = {n: r for n, r in ev.matched.items() if CHAIN.get(n) not in wrong}
        return named(stage.replace(other, role, 1), origin, words, matched)
    return None


def _nearest_held(ev: Evidence, index: int) -> int:
    """``index`` when it equals a projection chain's stage, else the latest record it was made from that does (the
    keys a rotation took, when the rotated keys match nothing: NeoX's ``key = qkv[:, :, 2]``, the value's slot)."""
    if ev.chains(index):
        return index
    held = [i for i in ev.ancestors(index) if i != index and ev.chains(i)]
    return max(held) if held else index


def _origin(ev: Evidence, index: int, chain: str) -> Record:
    """The first record of ``chain`` that record ``index`` was made from (following inputs of that chain back)."""
    rec = ev.records[index]
    while True:
        parents = [i for i in rec.inputs if chain in ev.chains(i)]
        if not parents:
            return rec  # made here
        joined = len(rec.args) > 1 and any(i is None or chain not in ev.chains(i) for i in rec.args)
        if joined and tuple(rec.value.shape) != tuple(ev.records[parents[0]].value.shape):
            return rec  # joined here to what is not of the chain (a cache the values were appended to)
        rec = ev.records[parents[0]]  # or only scaled by it (``k * cos``: rotary tables, a gain)
