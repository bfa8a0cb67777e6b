"""Snapshotting and restoring a module's KV-cache state, for classes that have no ``rewind_cache``.

The decode timer decodes the same position again and again, so the cache must be put back after each
step. The built-ins rewind (``rewind_cache(1)``); a class written as in the book's chapter 4
(``forward(x, use_cache=False)`` and ``reset_cache()``, nothing else) does not. For those the state a
step changes is found once, on a probe step, and put back after every timed step, outside the timed region:

* tensors the step *replaces* (``self.cache_k = torch.cat([self.cache_k, k], dim=2)``): the old
  reference is put back (nothing is copied);
* tensors it *writes in place* (a preallocated cache): the region that changed is copied back from a
  copy of that region only (one token's slots, not the whole cache);
* counters and other plain values (``self.ptr_cur``), items of lists and dicts, and attributes the step
  added (removed again).

State is what the module and its submodules hold in their attributes and buffers (parameters, submodules
and hooks are not state), followed into lists, tuples, dicts and plain objects (a cache object).
:func:`step_restorer` checks that a restored step decodes the same token again; a class whose state is
out of reach (a global, a closure, a C++ object changed in place) gets :class:`CacheRestoreError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnbench.errors import AttnbenchError

RESET_METHODS = ("reset_cache", "reset_kv_cache", "clear_cache", "clear_kv_cache", "reset_caches", "clear_caches",
                 "reset_kv", "clear_kv")
"""Names of the method that empties a KV cache, as codebases spell it (the book's is ``reset_cache``)."""

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
_MAX_DEPTH = 4  # module attribute -> cache object -> dict -> list -> tensor


class CacheRestoreError(AttnbenchError, RuntimeError):
    """A decode step changes state that attnbench cannot put back, so the same token cannot be timed again."""


def reset_method(obj) -> str | None:
    """The name of ``obj``'s cache-reset method (a module or a class), or ``None``."""
    base = getattr(obj, "_orig_mod", obj)
    return next((name for name in RESET_METHODS if callable(getattr(base, name, None))), None)


def reset_cache(module: nn.Module) -> None:
    """Empty ``module``'s KV cache through whichever reset method it has (``reset_cache``, ``clear_cache``, ...)."""
    name = reset_method(module)
    if name is None:
        raise CacheRestoreError(f"{type(module).__name__} has no cache-reset method (one of {', '.join(RESET_METHODS)})")
    getattr(module, name)()


# -- paths into the state -------------------------------------------------------------------------------
# A path is (holder, kind, key): ``holder`` the object or container, ``kind`` attr | buffer | item.

@dataclass
class _Entry:
    holder: object
    kind: str  # attr (an object's __dict__) | buffer (a module's _buffers) | item (a list or dict element)
    key: object
    value: object
    copy: torch.Tensor | None = None  # a tensor's content before the step (probe only)
    shallow: object = None  # a list's or dict's items before the step (identity compared)

    def current(self):
        if self.kind == "buffer":
            return self.holder._buffers.get(self.key, _MISSING)
        if self.kind == "attr":
            return self.holder.__dict__.get(self.key, _MISSING)
        try:
            return self.holder[self.key]
        except (IndexError, KeyError):
            return _MISSING

    def put_back(self) -> None:
        if self.kind == "buffer":
            self.holder._buffers[self.key] = self.value
        elif self.kind == "attr":
            self.holder.__dict__[self.key] = self.value
        else:
            self.holder[self.key] = self.value


_MISSING = object()


def _state(module: nn.Module, copies: bool) -> list[_Entry]:
    """Every piece of cache state in ``module``, outermost first (``copies``: keep each tensor's content)."""
    entries: list[_Entry] = []
    seen: set[int] = set()

    def visit(holder, kind, key, value, depth) -> None:
        if isinstance(value, nn.Module | nn.Parameter) or callable(value) and not isinstance(value, torch.Tensor) \
                and not getattr(value, "attnbench_state", False):  # a callable cache object that says it is state
            return
        entry = _Entry(holder, kind, key, value)
        entries.append(entry)
        if isinstance(value, torch.Tensor):
            if copies:
                entry.copy = value.detach().clone()
            return
        if isinstance(value, _PLAIN) or depth >= _MAX_DEPTH or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, list | tuple):
            if isinstance(value, list):
                entry.shallow = list(value)
            for i, item in enumerate(value):
                visit(value, "item", i, item, depth + 1)
        elif isinstance(value, dict):
            entry.shallow = dict(value)
            for k, item in list(value.items()):
                visit(value, "item", k, item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for k, item in list(vars(value).items()):
                visit(value, "attr", k, item, depth + 1)

    for mod in module.modules():
        for name, value in list(mod.__dict__.items()):
            if name not in _MODULE_INTERNALS:
                visit(mod, "attr", name, value, 0)
        for name, value in list(mod._buffers.items()):
            visit(mod, "buffer", name, value, 0)
    return entries


def _changed_region(before: torch.Tensor, after: torch.Tensor) -> tuple[slice, ...] | None:
    """The smallest box of indices outside which ``after`` equals ``before`` (``None``: nothing changed)."""
    same = before == after
    if before.is_floating_point() or before.is_complex():
        same = same | (before.isnan() & after.isnan())
    if bool(same.all()):
        return None
    where = (~same).nonzero()  # (n, ndim)
    lo, hi = where.min(dim=0).values.tolist(), where.max(dim=0).values.tolist()
    return tuple(slice(a, b + 1) for a, b in zip(lo, hi, strict=True))


@dataclass
class Restorer:
    """Puts back what one decode step changed (found on a probe step by :func:`step_restorer`)."""

    actions: list[Callable[[], None]] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # what the step changes, in words (for notes and ``check -v``)
    inference: bool = False  # some tensor written in place is an inference tensor: copy inside inference_mode

    def __call__(self) -> None:
        """Restore the state (call after every step, outside the timed region)."""
        ctx = torch.inference_mode() if self.inference else torch.no_grad()
        with ctx:
            for action in self.actions:
                action()

    def describe(self) -> str:
        """``replaces cache_k, cache_v; counter ptr_cur``, or ``changes nothing``."""
        return "; ".join(self.changed) or "changes nothing"


def _name(module: nn.Module, entry: _Entry) -> str:
    if isinstance(entry.holder, nn.Module):
        path = next((n for n, m in module.named_modules() if m is entry.holder), "")
        return f"{path}.{entry.key}" if path else str(entry.key)
    return f"{type(entry.holder).__name__}[{entry.key!r}]" if entry.kind == "item" else f"{type(entry.holder).__name__}.{entry.key}"


def _plan(module: nn.Module, before: list[_Entry]) -> Restorer:
    """What to do after a step to undo it, from the state ``before`` it (with copies) and the module now."""
    plan = Restorer()
    replaced, written, values = [], [], []
    for e in before:
        now = e.current()
        if now is not e.value:
            if isinstance(e.value, _PLAIN) and isinstance(now, _PLAIN) and type(now) is type(e.value) and now == e.value:
                continue
            plan.actions.append(e.put_back)
            (replaced if isinstance(e.value, torch.Tensor) else values).append(_name(module, e))
            continue
        if e.shallow is not None and _items_changed(e.value, e.shallow):
            plan.actions.append(_refill(e.value, e.shallow))
            values.append(_name(module, e))
        if isinstance(e.value, torch.Tensor) and e.copy is not None:
            t = e.value
            if t.shape != e.copy.shape:
                saved = e.copy
                plan.actions.append(lambda t=t, saved=saved: t.resize_(saved.shape).copy_(saved))
            else:
                region = _changed_region(e.copy, t)
                if region is None:
                    continue
                saved = e.copy[region].clone()
                plan.actions.append(lambda t=t, region=region, saved=saved: t[region].copy_(saved))
            plan.inference = plan.inference or t.is_inference()
            written.append(_name(module, e))
    added = _added(module, before)
    for holder, kind, key in added:
        plan.actions.append(lambda h=holder, k=kind, key=key: (h._buffers if k == "buffer" else h.__dict__).pop(key, None))
    if replaced:
        plan.changed.append(f"replaces {', '.join(replaced)}")
    if written:
        plan.changed.append(f"writes in place into {', '.join(written)}")
    if values:
        plan.changed.append(f"changes {', '.join(values)}")
    if added:
        plan.changed.append(f"adds {', '.join(str(k) for _, _, k in added)}")
    return plan


def _items_changed(container, saved) -> bool:
    """Whether a list or dict holds other objects (by identity) than ``saved``, its items before the step."""
    if isinstance(container, list):
        return len(container) != len(saved) or any(a is not b for a, b in zip(container, saved, strict=True))
    return set(container) != set(saved) or any(container[k] is not v for k, v in saved.items())


def _refill(container, saved) -> Callable[[], None]:
    def refill() -> None:
        if isinstance(container, list):
            container[:] = saved
        else:
            container.clear()
            container.update(saved)

    return refill


def _added(module: nn.Module, before: list[_Entry]) -> list[tuple[object, str, str]]:
    """Module attributes and buffers that exist now but did not before the step."""
    had = {(id(e.holder), e.kind, e.key) for e in before if isinstance(e.holder, nn.Module)}
    out = []
    for mod in module.modules():
        for name in mod.__dict__:
            if name not in _MODULE_INTERNALS and (id(mod), "attr", name) not in had:
                value = mod.__dict__[name]
                if not (isinstance(value, nn.Module | nn.Parameter) or callable(value) and not isinstance(value, torch.Tensor)):
                    out.append((mod, "attr", name))
        out += [(mod, "buffer", name) for name in mod._buffers if (id(mod), "buffer", name) not in had]
    return out


def _same(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool(((a - b).abs() <= 1e-5 * max(scale, 1.0)).all()) or bool(torch.equal(a, b))


def step_restorer(module: nn.Module, step: Callable[[], torch.Tensor], what: str = "") -> Restorer:
    """How to undo ``step()`` on ``module``'s cache: runs the step once (a probe), restores, runs it again and
    checks that the restored step decodes the same token; the state is restored when it returns.

    Raises :class:`CacheRestoreError` (one line) when the second step's output differs: the class keeps
    state attnbench cannot reach. ``what`` names the class in the message.
    """
    base = getattr(module, "_orig_mod", module)
    with torch.no_grad():
        before = _state(base, copies=True)
        first = step()
        plan = _plan(base, before)
        del before
        plan()
        again = step()
        plan()
    if not _same(first, again):
        name = what or type(base).__name__
        raise CacheRestoreError(
            f"{name}'s decode step changes state attnbench cannot restore: after putting back what it can see (the step "
            f"{plan.describe()}), decoding the same token again gives another output; keep the cache in tensor "
            "attributes or buffers, or give the class rewind_cache(n) (docs/variants.md: Decoding with a KV cache)")
    return plan


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` for the block: a cache allocated as ``torch.zeros(..., device=x.device)``
    (the book's optimized KV cache) then gets the model's dtype, as it would in a model run in that dtype."""
    before = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def grown_cache_tensors(module: nn.Module, prefill: Callable[[], object]) -> tuple[list[torch.Tensor], list[str]]:
    """Run ``prefill()`` and return the tensor attributes and buffers it created, grew or wrote into, with their
    names (how a class without ``cache_tensors()`` shows its cache; a buffer preallocated in ``__init__`` is written)."""
    base = getattr(module, "_orig_mod", module)
    before = {(id(e.holder), e.kind, e.key): (e.value, _version(e.value)) for e in _state(base, copies=False)
              if isinstance(e.value, torch.Tensor)}
    prefill()
    tensors, names = [], []
    for e in _state(base, copies=False):
        if not isinstance(e.value, torch.Tensor) or isinstance(e.value, nn.Parameter):
            continue
        old, version = before.get((id(e.holder), e.kind, e.key), (None, None))
        created = old is None
        grew = old is not None and old is not e.value and e.value.untyped_storage().nbytes() > old.untyped_storage().nbytes()
        wrote = old is e.value and version is not None and _version(e.value) != version
        if created or grew or wrote:
            tensors.append(e.value)
            names.append(_name(base, e))
    return tensors, names


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), or None for an inference tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None
