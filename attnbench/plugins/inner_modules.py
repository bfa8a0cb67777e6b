"""Classes that are not a whole attention layer by themselves, refused as such before any probe (issue 46, item 4).

* **An inner attention passed in.** Informer's ``AttentionLayer(attention, d_model, n_heads, ...)`` projects q, k and
  v and calls ``self.inner_attention(queries, keys, values, attn_mask)``, a module its caller builds: a required
  constructor parameter that ``__init__`` stores on ``self`` and ``forward`` calls. attnbench cannot supply it (the
  layer's function is the module's), so the class is refused naming the parameter and the call, with the adapter as
  the way on, instead of a later symptom of an int where a module was expected (``'int' object is not callable``).
  Projection modules a constructor takes (torchtune's ``q_proj``, ...) are built by attnbench and are not this.
* **No weights.** Informer's ``FullAttention`` takes queries, keys and values already projected and split per head:
  with no weight matrix at all it is an attention kernel, not a layer, and it is refused as that, instead of "not
  causal with any mask form" after every form raised.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path

from torch import nn


def _source_tree(fn) -> tuple[ast.AST, str, int] | None:
    try:
        lines, start = inspect.getsourcelines(fn)
        path = inspect.getsourcefile(fn) or "?"
        shown = os.path.relpath(path) if path != "?" and Path(path).resolve().is_relative_to(Path.cwd()) else path
        return ast.parse(textwrap.dedent("".join(lines))), shown, start
    except (OSError, TypeError, SyntaxError):
        return None


def _stored(init_tree: ast.AST, names: set[str]) -> dict[str, str]:
    """``{attribute: parameter}`` for each ``self.attribute = parameter`` of ``__init__`` with a parameter in ``names``."""
    out = {}
    for node in ast.walk(init_tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in names:
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out[t.attr] = node.value.id
    return out


def inner_module(target, params: list[inspect.Parameter], supplied: set[str]) -> str | None:
    """Why ``target`` cannot be built by attnbench: a required constructor parameter (not in ``supplied``, the ones
    attnbench builds modules for) that ``__init__`` stores and ``forward`` calls; None when there is none."""
    required = {p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    init = _source_tree(getattr(target, "__init__", None)) if inspect.isclass(target) else None
    forward = _source_tree(getattr(target, "forward", None)) if init is not None else None
    if init is None or forward is None:
        return None
    stored = _stored(init[0], required - supplied)
    tree, path, start = forward
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"
                and f.attr in stored):
            return (f"its constructor takes {stored[f.attr]!r}, a module its forward calls (self.{f.attr}(...) at "
                    f"{path}:{start + node.lineno - 1}), which its caller builds and attnbench cannot supply: the layer's "
                    "attention is that module's")
    return None


def no_weights(module) -> str | None:
    """Why ``module`` is an attention kernel rather than a layer: no weight matrix at all; None otherwise."""
    if not isinstance(module, nn.Module) or any(p.dim() >= 2 for p in module.parameters()):
        return None
    return ("it has no weight matrices: it takes queries, keys and values already projected (an attention kernel, not "
            "a layer that projects its input)")
