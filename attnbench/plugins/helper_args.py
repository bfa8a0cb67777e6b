"""A forward argument that is a module of the class's own code (issue 46, round 18).

gongyisheng's Qwen3 layer takes its rotary embedding as an argument, ``forward(x, rope: RoPE, position_ids, ...)``,
made once by its model from ``RoPE(head_dim, base, max_seq_len)``. A parameter annotated with an ``nn.Module`` class
is such a helper: attnbench builds it for each case's spec by its constructor's names (the same names a class's own
constructor is read by: ``head_dim``, ``base`` as the RoPE theta, ``max_seq_len`` as the context length) and passes
it. A helper whose constructor takes a theta rotates whatever the spec says, so the class checks its RoPE cases only
(the spec's theta; 10,000 where the spec has none, on a probe). A parameter no name binds is refused by its name.
"""

from __future__ import annotations

import functools
import inspect
import sys

from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.plugins.aliases import BY_NAME as _BY_NAME
from attnbench.plugins.aliases import spec_values
from attnbench.spec import AttnSpec


def module_class(p: inspect.Parameter, target) -> type | None:
    """The ``nn.Module`` subclass ``p`` is annotated with (a string annotation read in ``target``'s module), or, for a
    required parameter with no annotation, the one ``nn.Module`` class of ``target``'s module its name begins
    (``rope`` for ``RoPE``, ``rotary_emb`` for ``RotaryEmbedding``); None otherwise."""
    module = sys.modules.get(getattr(target, "__module__", ""), None)
    ann = p.annotation
    if isinstance(ann, str):
        ann = getattr(module, ann.strip("'\" "), None)
    if ann is p.empty and p.default is p.empty and module is not None:
        word = p.name.replace("_", "").lower()
        named = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, nn.Module)
                 and c is not target and c.__module__ == module.__name__ and len(word) >= 3
                 and c.__name__.lower().startswith(word)]
        exact = [c for c in named if c.__name__.lower() == word]  # RoPE for rope, before RopeCache
        ann = exact[0] if len(exact) == 1 else named[0] if len(named) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, nn.Module) and ann is not nn.Module else None


def _params(cls: type) -> list[inspect.Parameter]:
    try:
        return [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def rotates(cls: type) -> bool:
    """Does the helper's constructor take a RoPE theta?"""
    return any(_BY_NAME.get(p.name) == "rope_theta" for p in _params(cls))


@functools.lru_cache(maxsize=32)
def build_helper(cls: type, spec: AttnSpec, device=None) -> nn.Module:
    """``cls`` built for ``spec`` by its constructor's names (see the module's doc), once per spec and device (the
    forward's every call gets the same one, as from its model: building it is no part of a timed step)."""
    values = spec_values(spec)
    kwargs = {}
    for p in _params(cls):
        field = _BY_NAME.get(p.name)
        if field is None:
            if p.default is p.empty:
                raise PluginLoadError(f"{cls.__qualname__}, which the forward takes as an argument, needs {p.name!r}, "
                                      "which attnbench cannot supply by its name")
            continue
        value = values.get(field)
        kwargs[p.name] = 10000.0 if field == "rope_theta" and value is None else value
    return cls(**kwargs).to(device)
