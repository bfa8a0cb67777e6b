"""A callable's real signature, seen through decorators that hide it behind ``(*args, **kwargs)``.

``inspect.signature`` follows ``__wrapped__``, which ``functools.wraps`` sets. Some decorators do not set it: in
transformers 5.25 the ``kernels`` package's ``use_kernelized_func`` replaces ``LlamaAttention.__init__`` with
``new_init(self, *args, **kwargs)``, which calls the original from its closure. Read naively, such a constructor takes
nothing by name, and ``layer_idx`` (now required) goes unfilled. :func:`signature` finds the function the wrapper
closes over (the one with the wrapper's own name, else the only function there) and reads that.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

_DEPTH = 8  # wrappers of wrappers, at most


def _only_varargs(sig: inspect.Signature) -> bool:
    """True when every parameter but a leading ``self`` is ``*args`` or ``**kwargs``."""
    params = [p for p in sig.parameters.values() if p.name != "self"]
    return bool(params) and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def wrapped_function(fn: Callable, name: str | None = None) -> Callable | None:
    """The function a ``(*args, **kwargs)`` wrapper closes over: the one named ``name`` (the wrapper's method name,
    ``__init__`` or ``forward``), else the only function in its closure; ``None`` when neither is there."""
    cells = getattr(fn, "__closure__", None) or ()
    found = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(value) and value is not fn:
            found.append(value)
    named = [f for f in found if name is not None and f.__name__ == name]
    if named:
        return named[0]
    return found[0] if len(found) == 1 else None


def unwrap(fn: Callable, name: str | None = None) -> Callable:
    """``fn`` itself, or the function that its ``(*args, **kwargs)`` wrappers (any depth) finally call."""
    for _ in range(_DEPTH):
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return fn
        inner = wrapped_function(fn, name) if _only_varargs(sig) else None
        if inner is None:
            return fn
        fn = inner
    return fn


def signature(target: Callable) -> inspect.Signature:
    """``inspect.signature(target)``, seen through hiding wrappers. A class reads as its ``__init__`` without
    ``self`` (as ``inspect.signature(cls)`` does); a function or method as itself. Raises as ``inspect`` does."""
    if inspect.isclass(target):
        init = target.__init__
        real = unwrap(init, "__init__")
        if real is init:
            return inspect.signature(target)
        sig = inspect.signature(real)
        return sig.replace(parameters=list(sig.parameters.values())[1:])  # self
    name = getattr(target, "__name__", None)
    real = unwrap(getattr(target, "__func__", target), name)
    if real is getattr(target, "__func__", target):
        return inspect.signature(target)
    sig = inspect.signature(real)
    if inspect.ismethod(target):  # bound: drop self, as inspect does for a bound method
        return sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def parameters(target: Callable) -> dict[str, inspect.Parameter]:
    """The parameters of :func:`signature` by name."""
    return dict(signature(target).parameters)
