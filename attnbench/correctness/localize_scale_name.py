"""A scale held in a local name and applied on several lines (issue 47).

guided-diffusion's ``QKVAttention`` sets ``scale = 1 / math.sqrt(math.sqrt(ch))`` and multiplies both q and k by it
on two lines of one call. Planted as ``scale = 1 / math.sqrt(ch)``, q and k are each off by the same factor, and the
first line found is one of the two products; the bug is neither, but the assignment both read. :func:`shared_scale`
names that assignment when the line ``div`` stands at multiplies (or divides) by a local name, another recorded line
applies the same name, every such product is its stage times the same factor, and the assignment made no tensor.
"""

from __future__ import annotations

import ast
import linecache
import math
from dataclasses import replace

from attnbench.correctness.localize_finding import CHAIN, Evidence, Localization, named
from attnbench.correctness.localize_names import innermost
from attnbench.correctness.localize_scale import EXACT, FACTOR_STAGES, factor_of, score_scale

SCALINGS = (ast.Mult, ast.Div)
MULTIPLIES = frozenset({"mul", "Tensor.mul", "Tensor.__mul__", "Tensor.__rmul__", "Tensor.mul_", "Tensor.__imul__",
                        "div", "Tensor.div", "Tensor.__truediv__", "Tensor.div_", "Tensor.__itruediv__"})
"""Calls that scale a tensor by a number."""


def _scaling_names(path: str, line: int) -> list[str]:
    """The plain names that a product or quotient on ``line`` multiplies or divides by."""
    stmt = innermost(path, line, ast.stmt)
    names = []
    for node in ast.walk(stmt) if stmt is not None else ():
        if isinstance(node, ast.BinOp) and isinstance(node.op, SCALINGS) and node.lineno <= line <= node.end_lineno:
            names += [side.id for side in (node.left, node.right) if isinstance(side, ast.Name)]
    return names


def _assignment(path: str, line: int, name: str) -> int | None:
    """The line of the last plain assignment of ``name`` before ``line`` in the function holding ``line``."""
    func = innermost(path, line, (ast.FunctionDef, ast.AsyncFunctionDef))
    found = [n.lineno for n in ast.walk(func) if isinstance(n, ast.Assign) and n.lineno < line
             and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)] if func is not None else []
    return max(found, default=None)


def shared_scale(div, ev: Evidence) -> Localization | None:
    """The assignment of a local scale applied on two or more lines by the same factor, when that factor explains
    ``div``'s: the factor itself at a query or key stage, its power over the score scale at the scores (see the
    module's doc); ``None`` otherwise."""
    factor, rec = div.fit.factor, div.rec
    chain = CHAIN.get(div.name) in ("q", "k")
    scale = score_scale(ev)
    if (not chain and div.name not in FACTOR_STAGES) or not math.isfinite(factor) or abs(factor - 1) <= EXACT \
            or div.fit.fit > ev.tol or not scale:
        return None
    applied: dict[str, dict[int, float]] = {}
    for r in ev.records:
        c = factor_of(r, ev) if r.path == rec.path and r.op in MULTIPLIES else math.nan
        for name in _scaling_names(r.path, r.line) if math.isfinite(c) else ():
            applied.setdefault(name, {})[r.line] = c
    for name, lines in applied.items():
        c = next(iter(lines.values()))
        if len(lines) < 2 or any(abs(v - c) > EXACT * abs(c) for v in lines.values()):
            continue
        want = c if chain else c ** len(lines) / scale
        line = _assignment(rec.path, rec.line, name)
        if abs(want - factor) > EXACT * abs(factor) or line is None or any(
                r.path == rec.path and r.line == line for r in ev.records):
            continue
        words = (f"{name} = {c:.4g}, set here, scales the lines {', '.join(str(n) for n in sorted(lines))}, and "
                 f"{div.name} at {rec.where} is {div.fit.words(ev.tol)}")
        return named(div.name, replace(rec, line=line, text=linecache.getline(rec.path, line).strip()), words,
                     ev.matched)
    return None
