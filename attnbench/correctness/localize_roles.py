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
from dataclasses import replace

from attnbench.correctness.localize_finding import CHAIN, Evidence, Localization, named
from attnbench.correctness.localize_names import reads_as, rename_site
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


def reads_in_order(rec: Record | None) -> bool:
    """Whether the line that computes the scores spells its operands as the queries, then the keys: a swap of the two
    tensors it takes was then made before it (``k, q, v = qkv.chunk(3)``), not by it (``k @ q.transpose``)."""
    if rec is None:
        return False
    for pattern in OPERANDS:
        found = pattern.search(rec.text)
        if found is not None:
            return reads_as(found.group(1), "q") and reads_as(found.group(2), "k")
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
        site = rename_site(ev.records, index, role, other, lambda i, c=other: c in ev.chains(i), _user(ev, role))
        if site is None and owner is not None and (_origin(ev, owner, other) is origin
                                                   or _nearest_held(ev, owner) == index):
            continue  # one tensor in two roles (or slices of one: k[:, :, :stop] as values): where it is used is the bug
        stage = next(n for n in ev.explained[origin.index] if CHAIN.get(n) == other)
        swapped = owner is not None and ev.chains(owner) == {role}
        words = (f"holds the reference's {stage}" + (f", and the tensor used as {other} holds its {role}" if swapped
                                                       else "") +
                 f" ({f'{role} and {other} swapped' if swapped else f'used as {role}'}; first seen at "
                 f"{div.rec.where}: {div.fit.words(ev.tol)})")
        if site is not None:
            words += f"; it is named {other} where it is made, at {origin.where}"
            origin = replace(site[0], line=site[1], text=site[2])
        wrong = {role, other} if swapped else {role}
        matched = {n: r for n, r in ev.matched.items() if CHAIN.get(n) not in wrong}
        return named(stage.replace(other, role, 1), origin, words, matched)
    return None


def _user(ev: Evidence, role: str) -> Record | None:
    """The call that takes the class's ``role`` tensor in that role: the scores' (or the fused attention's) for
    ``q`` and ``k``, the product that applies the weights for ``v``."""
    scores = _scores_record(ev)
    if scores is None or role != "v" or scores.op in FUSED_ATTENTION:
        return scores
    later = ev.descendants(scores.index)
    return next((r for r in ev.records[scores.index + 1:] if r.op in PRODUCTS and any(i in later for i in r.inputs)
                 and any(i not in later for i in r.args if i is not None)), None)


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
        if not parents or len(ev.chains(parents[0])) > 1:
            return rec  # made here, or sliced here from a fused q, k, v (Bloom's ``fused[..., 2, :]``)
        joined = len(rec.args) > 1 and any(i is None or chain not in ev.chains(i) for i in rec.args)
        if joined and tuple(rec.value.shape) != tuple(ev.records[parents[0]].value.shape):
            return rec  # joined here to what is not of the chain (a cache the values were appended to)
        rec = ev.records[parents[0]]  # or only scaled by it (``k * cos``: rotary tables, a gain)


def values_from_other(div, ev: Evidence) -> Localization | None:
    """At ``v``/``v heads``, which nothing matches: the tensor the attention weights are applied to, made from the
    reference's keys (or queries) and from no value (``v = k.contiguous().view(...)``), named at the first step that
    took it from that chain."""
    if CHAIN.get(div.name) != "v" or "probabilities" not in ev.matched:
        return None
    later = ev.descendants(ev.matched["probabilities"].index)
    for rec in ev.records:
        taken = [i for i in rec.args if i is not None and i not in later]
        if rec.op not in PRODUCTS or len(taken) != 1 or not any(i in later for i in rec.args):
            continue
        made_from = ev.ancestors(taken[0])
        held = [i for i in made_from if ev.chains(i)]
        chains = set().union(*(ev.chains(i) for i in held)) if held else set()
        if len(chains) != 1 or "v" in chains:
            return None
        last = max(held)
        step = min(i for i in made_from if i > last and last in ev.ancestors(i))
        stage = next(n for n in ev.explained[last] if CHAIN.get(n))
        words = (f"the tensor the weights are applied to (at {rec.where}) is made from the reference's {stage} "
                 f"({ev.records[last].where}), not from v: {div.fit.words(ev.tol)}")
        return named(div.name, ev.records[step], words, {n: r for n, r in ev.matched.items() if CHAIN.get(n) != "v"})
    return None
