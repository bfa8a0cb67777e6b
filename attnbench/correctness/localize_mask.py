"""A mask made wrong where it was made, not where it was applied (issue 47).

A causal mask is usually made on one line (``torch.triu(..., diagonal=1)``, a slice of a registered buffer) and
applied on another (``masked_fill``, ``scores + mask``, SDPA's ``attn_mask``). What differs first is the applied
scores, but the line that is wrong is where the mask got its pattern. The recorder keeps the tensors the class's
forward makes from no input (:class:`~attnbench.correctness.localize_record.Aux`) and which of them each recorded call
took. When the divergence's call took a mask whose hidden positions are not the reference's in either polarity
(bool hide or keep, float ``-inf``/large negative, 1/0 keep or hide), the mask is followed back through the tensors it
was made from while they are wrong too (a constant ``torch.ones``/``torch.full`` says nothing and stops the walk):
the first wrong one is named, or, when that is a module buffer, the ``__init__`` line that registered it (the line
that made the tensor it registers, when that is a name: ``neg = ...triu(2)``, ``register_buffer("mask", neg)``). A mask that
has the reference's pattern leaves the divergence where it was: then the application is what is wrong.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import replace

import torch

from attnbench.correctness.localize_finding import Evidence, Localization, named
from attnbench.correctness.localize_match import MASKED
from attnbench.correctness.localize_record import argument_line, held_tensor

RIGHT, WRONG, UNKNOWN = "right", "wrong", "unknown"
ADDS = frozenset({"add", "Tensor.add", "Tensor.add_", "Tensor.__add__", "Tensor.__radd__", "Tensor.__iadd__"})
"""Calls that apply a float mask by adding it to the scores."""
AFTER_MASK = ("masked scores", "capped scores", "probabilities", "probabilities @ V")
"""The stages a wrong mask is first seen at (SDPA given an ``attn_mask`` fuses the scores to its output)."""


def mask_origin(div, ev: Evidence, made) -> Localization | None:
    """The line where the mask ``div``'s call applied got a pattern that is not the reference's; ``None`` when its
    masks are right, or unknown (see the module's doc)."""
    if made is None or ev.stage("masked scores") is None or div.name not in AFTER_MASK:
        return None
    aux, arg_ids, buffers, module, *full = made  # full: a decode call's whole pattern so far (localize_decode)
    full = full[0] if full else None
    hidden = ev.stage("masked scores").tensor.reshape(-1, *ev.stage("masked scores").tensor.shape[-2:])[0] <= MASKED
    for tid in arg_ids.get(div.rec.index, ()):
        if tid not in aux or not _mask_like(aux[tid].value):
            continue
        added = div.rec.op in ADDS and aux[tid].value.is_floating_point()
        if _pattern(aux[tid].value, hidden, full, added) != WRONG:
            continue
        origin = _walk(tid, aux, buffers, module, hidden, full)
        if isinstance(origin, str):
            found = _registered(module, origin)
            if found is None:
                return None
            path, line, text = found
            what = f"the mask buffer {origin!r} made here hides other positions than the reference's mask"
        else:
            path, line, text = origin.path, origin.line, origin.text
            what = ("the mask made here hides other positions than the reference's mask" if _mask_like(origin.value)
                    else "the positions made here, which the mask compares, are neither the keys' nor the queries'")
        rec = replace(div.rec, path=path, line=line, text=text, caller=None)
        return named("masked scores", rec, f"{what} (it is applied at {div.rec.where}: {div.fit.words(ev.tol)})",
                     ev.matched)
    return None


def _mask_like(value: torch.Tensor) -> bool:
    """A boolean tensor, or one whose values are 0 and 1 only or include masked ones (``-inf``, ``-1e9``)."""
    if value.dtype == torch.bool:
        return True
    v = value.detach().double()
    return bool((v <= MASKED).any()) or bool(((v == 0) | (v == 1)).all())


def _walk(tid: int, aux: dict, buffers: dict, module, hidden: torch.Tensor, full: torch.Tensor | None = None):
    """The earliest wrong tensor ``tid`` was made from, through wrong ones: an :class:`Aux`, or a buffer's name; a
    comparison of positions (``k_pos <= q_pos``) is followed to the one position vector that is not ``0..T-1``
    (keys) or ``T-t..T-1`` (queries)."""
    found = walk_back(tid, aux, buffers, lambda v: _mask_like(v) and _pattern(v, hidden, full) == WRONG,
                      lambda name: _pattern(_buffer(module, name), hidden, full) == WRONG)
    return found if isinstance(found, str) else _wrong_positions(found, aux, hidden) or found


def _wrong_positions(cur, aux: dict, hidden: torch.Tensor):
    """The one parent of ``cur`` (a mask made by comparing positions) that holds positions of neither the keys nor
    the queries, when its other parents hold those; else ``None``."""
    rows, cols = hidden.shape[-2:]
    keys, queries = torch.arange(cols), torch.arange(cols - rows, cols)
    wrong, right = [], 0
    for pid in cur.parents:
        vec = aux[pid].value.flatten().cpu() if pid in aux else None
        if vec is None or vec.is_floating_point() and not bool((vec == vec.round()).all()):
            continue
        if vec.numel() in (rows, cols) and (torch.equal(vec.long(), keys) or torch.equal(vec.long(), queries)):
            right += 1
        elif vec.numel() in (rows, cols):
            wrong.append(aux[pid])
    return wrong[0] if len(wrong) == 1 and right >= 1 else None


def walk_back(tid: int, aux: dict, buffers: dict, wrong, buffer_wrong):
    """From the made tensor ``tid`` back through its parents while they are wrong (``wrong(value)`` of a made tensor,
    ``buffer_wrong(name)`` of a module buffer): the earliest wrong :class:`Aux`, or the name of a wrong buffer it came
    from (the mask's and the rotary tables' walk: :func:`~attnbench.correctness.localize_tables.wrong_tables`)."""
    cur, seen = aux[tid], {tid}
    while True:
        nxt = None
        for pid in cur.parents:
            if pid in seen:
                continue
            seen.add(pid)
            if pid in aux:  # made by this forward (a buffer grown on demand: the line that made it, not its registration)
                if wrong(aux[pid].value):
                    nxt = aux[pid]
                    break
                continue
            if pid in buffers and buffer_wrong(buffers[pid]):
                return buffers[pid]
        if nxt is None:
            return cur
        cur = nxt


def _buffer(module, name: str) -> torch.Tensor:
    return held_tensor(module, name)


def _pattern(value: torch.Tensor, hidden: torch.Tensor, full: torch.Tensor | None = None, added: bool = False) -> str:
    """Whether ``value``, read as a mask in any polarity, hides the positions ``hidden`` (``(rows, keys)``) does; a
    larger one (a buffer for whole sequences) is read against ``full`` (a decode call's whole pattern so far) from
    its first row and key, when given. ``added``: a float mask added to the scores, which hides where it is very
    negative and nowhere else (``extended * finfo.min`` where ``(1 - extended) * finfo.min`` was meant is wrong)."""
    if value.dim() < 2:
        return UNKNOWN
    if full is not None and tuple(value.shape[-2:]) != tuple(hidden.shape[-2:]):
        hidden = full
    R, C = hidden.shape[-2:]
    if value.shape[-1] < C or value.shape[-2] < R:
        return UNKNOWN
    v = value[..., :R, :C].reshape(-1, R, C)[0].detach().cpu()
    if bool((v == v.flatten()[0]).all()):
        return UNKNOWN  # a constant (torch.ones, torch.full): no pattern yet
    if v.dtype == torch.bool:
        readings = (v, ~v)
    else:
        v = v.double()
        readings = (v <= MASKED,) if added and bool((v <= MASKED).any()) else (v <= MASKED, v == 0, v != 0)
    return RIGHT if any(torch.equal(r, hidden.cpu()) for r in readings) else WRONG


def _registered(module, name: str) -> tuple[str, int, str] | None:
    """``(path, line, text)`` of the statement of ``module``'s class (or a base's) that registers buffer ``name``."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    for cls in type(owner).__mro__:
        try:
            lines, start = inspect.getsourcelines(cls)
            path = inspect.getsourcefile(cls)
        except (OSError, TypeError):
            continue
        for i, text in enumerate(lines):
            if f'"{leaf}"' in text or f"'{leaf}'" in text or f"self.{leaf} =" in text:
                for back in range(i, max(i - 3, -1), -1):
                    if "register_buffer" in lines[back] or f"self.{leaf} =" in lines[back]:
                        line = _named_value(lines, back, leaf) or back
                        return path, start + line, lines[line].strip()
    return None


def _named_value(lines: list[str], at: int, leaf: str) -> int | None:
    """When the statement at ``lines[at]`` registers a local name (``register_buffer("mask", neg)``), the index of the
    line that last assigned that name before it; else None."""
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "register_buffer" and len(node.args) > 1
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == leaf
                and isinstance(node.args[1], ast.Name)):
            name, before = node.args[1].id, node.lineno - 1
            assigned = [n.lineno - 1 for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.lineno - 1 < before
                        and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
            return max(assigned, default=None)
    return None


IS_CAUSAL = re.compile("is_causal")
"""What sets a fused call's causal flag, on one of its lines."""


def sdpa_flag(div, ev: Evidence) -> Localization | None:
    """``scaled_dot_product_attention`` whose first query already differs (it sees later tokens): the line of its
    call that sets ``is_causal`` (a call spread over lines), when there is one and no mask was passed."""
    if "scaled_dot_product_attention" not in div.rec.op or ev.stage("probabilities @ V") is None:
        return None
    want = ev.stage("probabilities @ V")
    got = div.rec.value.double()
    first = want.tensor[:, :, 0] if want.axes.index("i") == 2 else None  # (b, h, d): every head's first query
    if first is None or got.dim() != 4 or got.shape[2] != want.tensor.shape[2]:
        return None
    if torch.allclose(got[:, :, 0], first.double(), rtol=1e-4, atol=1e-6 * float(first.abs().max())):
        return None  # the first query sees itself only, as in the reference: not the causal flag
    found = argument_line(div.rec.path, div.rec.line, IS_CAUSAL, span=12)
    if found is None:
        return None
    rec = replace(div.rec, line=found[0], text=found[1], caller=None)
    stage = "masked scores" if ev.stage("masked scores") is not None else div.name  # the mask is missing
    return named(stage, rec, "its first query sees later tokens: the call is not causal (is_causal set here, and no "
                             "mask given)", ev.matched)

