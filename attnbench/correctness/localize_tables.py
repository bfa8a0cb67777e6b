"""Rotary tables that are wrong, or passed in each other's place (issue 47).

When both rotated stages diverge, the rotation itself is shared: a helper right for queries and keys alike fed wrong
tables (a theta other than the spec's, positions shifted by a slice) or fed the right ones swapped
(``apply_rotary_pos_emb(q, k, sin, cos)``). The reference's tables are read off its own stages (``q * cos`` over
``q``, and what ``rotate(q)`` times the sine adds), and each table the class's code made from no input and multiplied
into the queries (:class:`~attnbench.correctness.localize_record.Aux`) is compared with them:

* the table multiplied into the queries themselves is the reference's sine while another is its cosine: the tables
  are passed in each other's place, named at the call of the helper (or the line, outside one);
* a table that is neither is named where it first became wrong: the earliest tensor it was made from that is wrong
  too (a shifted slice), or the ``__init__`` line that registered the buffer it came from.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_mask import _registered, walk_back
from attnbench.correctness.localize_record import held_tensor

STAGES = ("q * cos", "rotate(q)", "rotated q", "k * cos", "rotate(k)", "rotated k")
CLOSE = 1e-5


def wrong_tables(div, ev: Evidence, made) -> Localization | None:
    """The line of a wrong or swapped rotary table when both rotated stages diverge (see the module's doc)."""
    if made is None or div.name not in STAGES or "rotated q" in ev.matched or "rotated k" in ev.matched:
        return None
    ref = _reference(ev)
    if ref is None:
        return None
    queries = {i for i, names in ev.explained.items() if {"q heads", "normed q"} & set(names)}
    turned = {i for i, names in ev.explained.items() if "rotate(q)" in names}  # what the sine multiplies
    aux, arg_ids, buffers, module, *_ = made
    T, hd = ref["cos"].shape
    for rec in ev.records:
        if not (queries | turned) & set(rec.inputs):
            continue  # only a product with the queries themselves (or their turn) says which table stands where
        for tid in arg_ids.get(rec.index, ()):
            table = _table(aux[tid].value if tid in aux else None, T, hd)
            if table is None:
                continue
            if not queries & set(rec.inputs):  # the turned queries times the sine: wrong when it is neither table
                if not (_same(table, ref["sin"]) or _same(table, ref["cos"])):
                    return _origin(div, ev, tid, aux, buffers, module, ref, T, hd)
                continue
            if _same(table, ref["sin"]) and not _same(table, ref["cos"]):
                at = replace(rec, path=rec.caller[0], line=rec.caller[1], text=rec.caller[2], caller=None) \
                    if rec.caller is not None else rec
                return named(div.name, at, "the sine table is multiplied into the queries where the cosine belongs "
                                           f"(at {rec.where}): the tables are passed in each other's place",
                             ev.matched)
            if not _same(table, ref["cos"]):
                return _origin(div, ev, tid, aux, buffers, module, ref, T, hd)
    for tid, made_here in aux.items():  # complex tables (freqs_cis) multiply complex views no stage is compared with
        if made_here.value.is_complex() and _part(made_here.value, T, hd) is not None and not _right(
                made_here.value, ref, T, hd):
            return _origin(div, ev, tid, aux, buffers, module, ref, T, hd)
    return None


def _origin(div, ev: Evidence, tid: int, aux: dict, buffers: dict, module, ref: dict, T: int, hd: int):
    """The earliest wrong table ``tid`` was made from, or the buffer's registration, named."""
    origin = walk_back(tid, aux, buffers, lambda v: _part(v, T, hd) is not None and not _right(v, ref, T, hd),
                       lambda name: not _buffer_right(module, name, ref, T, hd))
    if isinstance(origin, str):
        found = _registered(module, origin)
        if found is None:
            return None
        rec = replace(div.rec, path=found[0], line=found[1], text=found[2], caller=None)
        return named(div.name, rec, f"the rotary table {origin!r} set here is not the reference's (its "
                                    "theta, positions or pairs differ)", ev.matched)
    rec = replace(div.rec, path=origin.path, line=origin.line, text=origin.text, caller=None)
    return named(div.name, rec, "the rotary table made here is not the reference's (its theta, positions or pairs "
                                "differ)", ev.matched)


def _buffer_right(module, name: str, ref: dict, T: int, hd: int) -> bool:
    """Whether a table buffer, for more positions than the case's (``(max_positions, head_dim)``, axes of size 1
    dropped), holds the reference's table at its first ``T`` positions: then a wrong slice of it is where it went
    wrong (``sin_cached[1:T + 1]``), not the buffer."""
    try:
        value = held_tensor(module, name)
    except AttributeError:
        return False
    value = value.reshape([n for n in value.shape if n != 1]) if value.numel() > 1 else value
    if not (value.is_floating_point() or value.is_complex()) or value.dim() != 2 or value.shape[0] < T:
        return False
    return _right(value[:T], ref, T, hd)


def _right(value, ref: dict, T: int, hd: int) -> bool:
    """Whether ``value`` is one of the reference's tables or what they are made of: the cosine or the sine ``(T,
    head_dim)``, the angles whose cosine and sine they are, or the same with each frequency once (``(T, head_dim/2)``,
    as the half or the interleaved form lays them out), or the frequencies themselves (the angles at position 1)."""
    part = _part(value, T, hd)
    if part is None:
        return False
    cos, sin = ref["cos"], ref["sin"]
    if part.dim() == 1:  # (head_dim/2,) frequencies: the angle each pair turns by per position
        angles = torch.atan2(sin[1], cos[1]) if T > 1 else None
        return angles is not None and any(_same(part, angles[cut]) for cut in (slice(0, hd // 2), slice(0, None, 2)))
    cuts = (slice(None),) if part.shape[-1] == hd else (slice(0, hd // 2), slice(0, None, 2))
    for cut in cuts:
        c, s = cos[:, cut], sin[:, cut]
        if _same(part, c) or _same(part, s) or (_same(torch.cos(part), c) and _same(torch.sin(part), s)):
            return True
    return False


def _part(value, T: int, hd: int) -> torch.Tensor | None:
    """``value`` as what a rotary table is made of: ``(T, head_dim)`` or ``(T, head_dim/2)`` (axes of size 1
    dropped), or the ``(head_dim/2,)`` frequencies; None when it is none of these (or is complex)."""
    if value is None or not (value.is_floating_point() or value.is_complex()):
        return None
    if value.is_complex():  # Meta's freqs_cis, (T, head_dim/2) unit numbers: their angles
        value = torch.angle(value)
    squeezed = value.reshape([n for n in value.shape if n != 1]) if value.numel() > 1 else value.reshape(-1)
    shape = tuple(squeezed.shape)
    if shape in ((T, hd), (T, hd // 2)) or (shape == (hd // 2,) and T != hd // 2):
        return squeezed.double().cpu()
    return None


def _reference(ev: Evidence) -> dict | None:
    """The reference's cosine and sine tables ``(T, head_dim)``, read off its stages (None without them)."""
    before = "normed q" if ev.stage("normed q") is not None else "q heads"  # what the rotation turns
    stages = {n: ev.stage(n) for n in (before, "q * cos", "rotate(q)", "rotated q")}
    if any(s is None for s in stages.values()):
        return None
    q, qc, rq, rot = (stages[n].tensor.double() for n in (before, "q * cos", "rotate(q)", "rotated q"))
    cos = (qc * q).sum(dim=(0, 2)) / (q * q).sum(dim=(0, 2)).clamp_min(1e-300)  # (T, hd): b, h summed out
    sin = ((rot - qc) * rq).sum(dim=(0, 2)) / (rq * rq).sum(dim=(0, 2)).clamp_min(1e-300)
    return {"cos": cos, "sin": sin}


def _table(value, T: int, hd: int) -> torch.Tensor | None:
    """``value`` as a ``(T, head_dim)`` table (its axes of size 1 dropped: ``(1, T, 1, hd)``, ``(T, 1, hd)``), or None."""
    part = _part(value, T, hd)
    return part if part is not None and tuple(part.shape) == (T, hd) else None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= CLOSE * max(1.0, float(b.abs().max())))
