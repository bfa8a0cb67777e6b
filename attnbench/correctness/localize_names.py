"""Where a tensor takes another's role, read from the names the class's source gives it (issue 47).

When the tensor the class uses as its keys holds the reference's values, the line that *made* it is the bug only when
that line already calls it a key (``q, v, k = qkv.split(n, dim=2)``, ``v = x @ self.W_k``). A tensor made and named
right (``v = self.value(x)``) that reaches the key's place was given that place later, on a line with no arithmetic
of its own:

- a line that renames it (``xq, xk, xv = (t.transpose(1, 2) for t in (xq, xv, xk))``, ``v = k.view(...)``);
- a plain assignment between two recorded calls (``keys, values = self.cache_k, self.cache_k``), found by following
  the names back through the function's assignments;
- the call that takes it in the other's place (``scaled_dot_product_attention(q, v, k)``), named at the argument.

:func:`rename_site` finds that line, or says nothing (``None``) when the names do not tell: a name that reads as no
role (``h``, ``t``, ``qkv``), or two candidate lines.
"""

from __future__ import annotations

import ast
import functools
import linecache

from attnbench.correctness.localize_record import Record

WORDS = {"q": ("query", "queries"), "k": ("key",), "v": ("value",)}
"""The words a name of each role starts with (``query_states``, ``keys``, ``values_new``)."""


def reads_as(name: str, role: str) -> bool:
    """Whether a variable name reads as ``role`` (``k``: ``k``, ``xk``, ``keys``, ``key_states``, ``k_rot``,
    ``self.cache_k``, ...)."""
    name = name.lower().rsplit(".", 1)[-1]
    return (name in (role, f"x{role}", f"{role}s") or name.startswith((*WORDS[role], f"{role}_"))
            or name.endswith(f"_{role}"))


def role_of(name: str | None) -> str | None:
    """The one role ``name`` reads as, or ``None`` (no role, or more than one)."""
    found = [r for r in "qkv" if name and reads_as(name, r)]
    return found[0] if len(found) == 1 else None


@functools.lru_cache(maxsize=16)
def _tree(path: str) -> ast.Module | None:
    try:
        return ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None


def innermost(path: str, line: int, kind: type) -> ast.AST | None:
    """The innermost node of ``kind`` (a statement, a function) of ``path`` that spans ``line``."""
    tree = _tree(path)
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, kind) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno and node.end_lineno <= best.end_lineno:
                best = node
    return best


def _dotted(node: ast.AST) -> str | None:
    """``x`` or ``self.cache_k`` for a name or attribute, else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and _dotted(node.value) is not None:
        return f"{_dotted(node.value)}.{node.attr}"
    return None


def _pairs(stmt: ast.stmt) -> list[tuple[str | None, ast.AST]]:
    """(target name, the expression it is bound to) of an assignment, element by element for ``a, b = c, d`` and
    ``a, b = (f(t) for t in (c, d))``; the expression is the whole value when it cannot be split."""
    if isinstance(stmt, ast.AugAssign):
        return [(_dotted(stmt.target), stmt.value)]
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
        return []
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
    if not isinstance(target, (ast.Tuple, ast.List)):
        return [(_dotted(target), stmt.value)]
    value = stmt.value
    if isinstance(value, (ast.GeneratorExp, ast.ListComp)) and isinstance(value.generators[0].iter, ast.Tuple):
        value = value.generators[0].iter
    if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
        return [(_dotted(t), v) for t, v in zip(target.elts, value.elts, strict=True)]
    return [(_dotted(t), value) for t in target.elts]


def _loads(node: ast.AST) -> list[str]:
    """The names and attributes an expression reads that read as some role."""
    found = [_dotted(n) for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
    return [n for n in found if n is not None and role_of(n) is not None]


def _finals(rec: Record, records: list[Record]) -> list[Record]:
    """The records made on ``rec``'s line that no other record of that line takes (what the line assigns)."""
    same = [r for r in records if (r.path, r.line, r.caller) == (rec.path, rec.line, rec.caller)]
    taken = {i for r in same for i in r.inputs}
    return [r for r in same if r.index not in taken]


def bound_name(rec: Record, records: list[Record]) -> tuple[str | None, ast.AST | None]:
    """(the name ``rec``'s line assigns it to, the expression that gives it), or ``(None, None)``: it is an
    intermediate of its line, or the line does not say (``out = f(a, b)`` assigns one name to several records)."""
    stmt = innermost(rec.path, rec.line, ast.stmt)
    pairs = _pairs(stmt) if stmt is not None else []
    finals = _finals(rec, records)
    if rec not in finals or not pairs:
        return None, None
    if len(pairs) == 1:
        return pairs[0]
    return pairs[finals.index(rec)] if len(finals) == len(pairs) else (None, None)


def _passed(value: ast.AST) -> str | None:
    """The name an assignment's value passes on: itself (``self.cache_k``), or the one argument of a call that
    reads as a role (``repeat_kv(value_states, n_rep)``, a helper that returns it, repeated or as it is)."""
    if isinstance(value, ast.Call):
        named_args = [_dotted(a) for a in value.args if role_of(_dotted(a)) is not None]
        return named_args[0] if len(named_args) == 1 else None
    return _dotted(value)


def _alias_site(rec: Record, name: str, role: str, since: int, before: int | None = None,
                depth: int = 3) -> tuple[int, str] | None:
    """The one plain assignment between lines ``since`` and ``before`` (``rec``'s line) of ``rec``'s function that
    binds ``name`` to a name of role ``role``, following names of ``name``'s own role back (``values =
    self.cache_v``, then ``self.cache_k, self.cache_v = k, k``); ``None`` when there is none or more than one."""
    func = innermost(rec.path, rec.line, (ast.FunctionDef, ast.AsyncFunctionDef))
    before = rec.line if before is None else before
    if func is None or depth == 0:
        return None
    sites = set()
    for stmt in ast.walk(func):
        if not isinstance(stmt, ast.stmt) or not since < stmt.lineno < before:
            continue
        for target, value in _pairs(stmt):
            source = _passed(value)
            if target != name or source is None:
                continue
            if role_of(source) == role:
                sites.add(stmt.lineno)
            elif role_of(source) == role_of(name):
                deeper = _alias_site(rec, source, role, since, stmt.lineno, depth - 1)
                sites |= {deeper[0]} if deeper else set()
    if len(sites) != 1:
        return None
    line = sites.pop()
    return line, linecache.getline(rec.path, line).strip()


def _path(records: list[Record], index: int, chain_of) -> list[Record]:
    """The records from where record ``index`` was first made to it, following the inputs ``chain_of(i)`` says hold
    the same chain."""
    path = [records[index]]
    while True:
        parents = [i for i in path[-1].inputs if chain_of(i)]
        if not parents:
            return path[::-1]
        path.append(records[parents[0]])


def rename_site(records: list[Record], index: int, role: str, other: str, chain_of,
                user: Record | None) -> tuple[Record, int, str] | None:
    """(a record near it, line, text) of the line that gave record ``index``, which holds the reference's ``other``
    and was named so where it was made, the place of ``role`` (see the module's doc); ``None`` when the names do not
    tell, or when the line that made it already names it ``role`` (the bug is where it was made). ``chain_of(i)``:
    whether record ``i`` holds ``other``'s chain; ``user``: the call that takes it as ``role`` (the scores' product,
    the weights' product, a fused attention)."""
    named_right, since = False, 0
    for rec in _path(records, index, chain_of):
        name, expr = bound_name(rec, records)
        if role_of(name) is None:
            continue
        if role_of(name) == other:
            named_right, since = True, rec.line
            continue
        if role_of(name) != role or not named_right:
            return None
        loads = _loads(expr)
        if {role_of(n) for n in loads} == {other}:
            return rec, rec.line, rec.text  # renamed on this line: ``v = k.view(...)``
        if len(set(loads)) == 1 and role_of(loads[0]) == role:
            site = _alias_site(rec, loads[0], other, since)
            return (rec, *site) if site else None
        return None
    return _operand_site(user, role, other, since) if named_right and user is not None else None


FUSED = ("query", "key", "value")
"""A fused attention's operands (``scaled_dot_product_attention(query, key, value)``), by position or keyword."""


def _in_place_of(node: ast.AST, role: str) -> list[ast.AST]:
    """The operand of a call or ``@`` that stands in ``role``'s place: a fused attention's ``role`` argument, or a
    product's first operand for ``q`` (``q @ k.T``) and its second for ``k`` and ``v`` (``p @ v``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return [node.left if role == "q" else node.right]
    if not isinstance(node, ast.Call):
        return []
    name = _dotted(node.func) or ""
    args = [a for a in node.args if not isinstance(a, ast.Constant)]  # einsum's equation
    if name.endswith("scaled_dot_product_attention"):
        slot = "qkv".index(role)
        keyword = [k.value for k in node.keywords if k.arg == FUSED[slot]]
        return keyword or args[slot:slot + 1]
    if name.rsplit(".", 1)[-1] in ("matmul", "bmm", "einsum", "baddbmm"):
        return args[-2 + (role != "q"):][:1] if len(args) >= 2 else []
    return []


def _operand_site(user: Record, role: str, other: str, since: int) -> tuple[Record, int, str] | None:
    """(user, line, text) of the operand of ``user``'s call (``q @ v.T``, ``sdpa(q, v, k)``) whose name reads as
    ``other`` (the argument's own line), or else of the plain assignment that bound an operand named as ``role`` to
    a name of ``other`` after line ``since`` (``keys, values = self.cache_k, self.cache_k``); ``None`` when neither
    is one line."""
    stmt = innermost(user.path, user.line, ast.stmt)
    if stmt is None:
        return None
    direct, aliased = set(), set()
    for node in ast.walk(stmt):
        for operand in _in_place_of(node, role):
            roles = {role_of(n) for n in _loads(operand)}
            if roles == {other}:
                direct.add(operand.lineno)
            elif roles == {role}:
                site = _alias_site(user, _loads(operand)[0], other, since)
                aliased |= {site[0]} if site else set()
    hits = direct or aliased
    if len(hits) != 1:
        return None
    line = hits.pop()
    return user, line, linecache.getline(user.path, line).strip()
