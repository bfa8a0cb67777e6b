"""The line of a statement written over several lines that holds a wrong scale (issue 47).

Python records one line for an operation: where its expression starts. A scale written as a call's argument on a line
of its own (``torch.full(\\n [], value.size(-1), ...)``, ``zeros.baddbmm(\\n batch1=q, batch2=k, alpha=1.0)``) is
made on the statement's first line, while the factor it is off by is written on the next. :func:`scale_line` moves a
localisation at a scaled stage to the one line of its statement that writes a size or a scale (a ``sqrt``, a power, a
``.size()`` or ``.shape``, a name or keyword with ``scale``, ``alpha`` or ``head_dim`` in it), when exactly one line
other than the first does and the first does not; otherwise it leaves it where it is.
"""

from __future__ import annotations

import ast
import linecache
from dataclasses import replace

from attnbench.correctness.localize_finding import Localization
from attnbench.correctness.localize_names import innermost

SCALED = frozenset({"scaled scores", "scaled q"})
"""The stages a wrong factor is named at."""

WORDS = ("scale", "scaling", "alpha", "head_dim", "d_k", "dk", "d_head", "head_size", "norm_fact", "temperature")
"""Fragments of a name or keyword that says it holds the scale or the size it is made from."""


def _says_scale(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return True
    if isinstance(node, ast.keyword) and node.arg is not None:
        return any(w in node.arg.lower() for w in WORDS)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    if name is None:
        return False
    return name in ("sqrt", "rsqrt", "size", "shape") or any(w in name.lower() for w in WORDS)


def scale_line(loc: Localization) -> Localization:
    """``loc`` at the line of its statement that writes the scale (see the module's doc), or ``loc`` unchanged."""
    if loc.stage not in SCALED or loc.path is None or loc.lineno is None:
        return loc
    stmt = innermost(loc.path, loc.lineno, ast.stmt)
    if stmt is None or stmt.lineno != loc.lineno or (stmt.end_lineno or stmt.lineno) == stmt.lineno:
        return loc
    lines = {node.lineno for node in ast.walk(stmt) if hasattr(node, "lineno") and _says_scale(node)}
    if loc.lineno in lines or len(lines) != 1:
        return loc
    (lineno,) = lines
    code = linecache.getline(loc.path, lineno).strip()
    line = loc.line.replace(f':{loc.lineno} "{loc.code}"', f':{lineno} "{code}"', 1)
    return replace(loc, line=line, lineno=lineno, code=code)
