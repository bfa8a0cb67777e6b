"""The registry of interchangeable multi-head attention implementations.

Built-ins (the ``implementations/`` folder, imported as ``attnbench.implementations``) and plug-ins go
through one path, :func:`register`. A name given anywhere an implementation is accepted resolves as:

* a registered name (``weight_split``, ``sdpa_flash``, ...);
* ``compiled:NAME`` or ``compiled:NAME@MODE``: ``torch.compile`` applied to ``NAME`` as a transform;
* ``deterministic:NAME``: ``NAME`` with every call under ``torch.use_deterministic_algorithms(True)`` (issue 48);
* ``hf:MODEL[@BACKEND]`` or ``hf:package.module:Class[@BACKEND]``: a Hugging Face ``transformers`` attention
  layer (``implementations/hf.py``), resolved on demand and so not among :func:`names` (default sweeps and
  checks leave it out); :func:`listed` adds the shipped ones for ``attnbench list``;
* ``path/to/file.py:ClassName`` or ``package.module:ClassName``: a user's class (its constructor bound
  by parameter name, its weight layout discovered: :mod:`attnbench.plugins`) or factory ``f(spec)``;
* ``NAME=target``: ``target`` shown as ``NAME`` in tables, figures and reports;
* plug-ins registered through the ``attnbench.implementations`` entry-point group (the entry point's
  name is the implementation's name; it points at such a class or at an :class:`Implementation`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from packaging.version import Version
from torch import nn

from attnbench import plugins
from attnbench import resolve as _resolve
from attnbench.errors import PluginLoadError, UnknownImplementationError
from attnbench.plugins import catalog
from attnbench.plugins.catalog import (  # noqa: F401  (re-exported: the registry's public names)
    ALL_DTYPES,
    Implementation,
    _first_line,
    register,
    register_prefix,
    unregister,
)
from attnbench.plugins.loading import import_module_path
from attnbench.resolve import Ready, Skip, variant_skip_reason  # noqa: F401  (re-exported)
from attnbench.spec import AttnSpec
from attnbench.weights import adapter_for

ENTRY_POINT_GROUP = "attnbench.implementations"
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_RESOLVED: dict[str, Implementation] = {}
"""Names resolved by :func:`get` (plug-ins, compiled:, hf:), forgotten whenever the catalog changes."""
_LOADED = {"builtins": False, "entry_points": False}
catalog._CHANGED.append(lambda: _RESOLVED.clear())  # the module's current dict (tests swap it)


def _load_builtins() -> None:
    if not _LOADED["builtins"]:
        _LOADED["builtins"] = True
        importlib.import_module("attnbench.implementations")


def _load_entry_points() -> None:
    if _LOADED["entry_points"]:
        return
    _LOADED["entry_points"] = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in catalog._REGISTRY:
            continue
        try:
            catalog._REGISTRY[ep.name] = _from_object(ep.name, ep.load(), source=ep.value, origin="entry-point")
        except Exception as exc:  # a broken plug-in must not hide the others: list it as unavailable
            reason = f"entry point {ep.value} failed to load: {type(exc).__name__}: {exc}"
            catalog._REGISTRY[ep.name] = Implementation(name=ep.name, factory=_raiser(reason), description=reason,
                                                source=ep.value, probe=lambda _d, r=reason: r, origin="entry-point")


def _raiser(message: str) -> Callable[[AttnSpec], nn.Module]:
    def factory(spec: AttnSpec) -> nn.Module:
        raise PluginLoadError(message)

    return factory


def _from_object(name: str, obj, source: str, origin: str) -> Implementation:
    if isinstance(obj, Implementation):
        return replace(obj, name=name, origin=origin)
    if callable(obj):  # a user's class or factory: bound by parameter name, weight layout discovered
        fields = plugins.implementation_fields(obj, source)
        return Implementation(name=name, description=fields.pop("description", _first_line(obj)), origin=origin, **fields)
    raise PluginLoadError(f"{source} is a {type(obj).__name__}; a plug-in must be an nn.Module subclass, a factory "
                          "callable(spec) -> nn.Module, or an attnbench Implementation (docs/own-attention.md)")


def _load_file(path_text: str, attr: str, name: str) -> Implementation:
    module = plugins.import_file(path_text)
    return _attr(module, attr, name, source=str(Path(path_text).expanduser().resolve()), origin="file")


def _load_module(mod_path: str, attr: str, name: str) -> Implementation:
    module = import_module_path(mod_path)  # a missing module is "not found"; a missing dependency is named as such
    return _attr(module, attr, name, source=f"{mod_path}:{attr}", origin="module")


def _attr(module, attr: str, name: str, source: str, origin: str) -> Implementation:
    obj = getattr(module, attr, None)
    if obj is None:
        public = [n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, nn.Module)
                  and v.__module__ == module.__name__]
        hint = difflib.get_close_matches(attr, public, n=3) or public[:5]
        raise PluginLoadError(f"{source.rsplit(':', 1)[0]} has no attribute {attr!r}"
                              + (f"; its nn.Module classes: {', '.join(hint)}" if hint else ""))
    return _from_object(name, obj, source=source, origin=origin)


def _compiled(name: str) -> Implementation:
    rest = name[len("compiled:"):]
    base_name, _, mode = rest.partition("@")
    if rest.startswith("hf:"):  # hf:NAME@BACKEND has an @ of its own: only a trailing compile mode is split off
        head, _, tail = rest.rpartition("@")
        base_name, mode = (head, tail) if tail in COMPILE_MODES else (rest, "")
    mode = mode or "default"
    if mode not in COMPILE_MODES:
        raise UnknownImplementationError(f"unknown torch.compile mode {mode!r} in {name!r}; use one of {', '.join(COMPILE_MODES)}")
    if base_name.startswith("compiled:"):
        raise UnknownImplementationError(f"{name!r} compiles twice; use compiled:NAME once")
    base = get(base_name)

    def transform(module: nn.Module, _mode=mode) -> nn.Module:
        compiled = torch.compile(module, mode=None if _mode == "default" else _mode)
        return compiled

    return replace(base, name=name, transform=transform,
                   description=f"torch.compile(mode={mode!r}) of {base_name}: {base.description}",
                   source=f"torch.compile over {base.source}", min_torch=max(base.min_torch, "2.1", key=Version))


def _deterministic(name: str) -> Implementation:
    """``deterministic:NAME`` (issue 48): ``NAME`` with its transform (if any), then every call under
    ``torch.use_deterministic_algorithms(True)`` (:mod:`attnbench.plugins.deterministic`)."""
    from attnbench.plugins.deterministic import PREFIX, DeterministicMode

    base_name = name[len(PREFIX):]
    if not base_name or base_name.startswith(PREFIX):
        raise UnknownImplementationError(f"{name!r}: give deterministic:NAME once, with an implementation's name")
    base = get(base_name)

    def transform(module: nn.Module, _inner=base.transform) -> nn.Module:
        return DeterministicMode(_inner(module) if _inner is not None else module)

    return replace(base, name=name, transform=transform,
                   description=f"torch.use_deterministic_algorithms(True) around {base_name}: {base.description}",
                   source=f"torch.use_deterministic_algorithms(True) around {base.source}")


def get(name: str) -> Implementation:
    """The :class:`Implementation` called ``name`` (see the module docstring for the accepted forms)."""
    display, name = plugins.split_display_name(name)
    if display is not None:  # NAME=target: the target under a short name for tables, figures and reports
        return replace(get(name), name=display)
    key = _cache_key(name)
    if key in _RESOLVED:
        return _RESOLVED[key]
    _load_builtins()
    if name in catalog._REGISTRY:
        return catalog._REGISTRY[name]
    if name.startswith("compiled:"):
        impl = _compiled(name)
    elif name.startswith("deterministic:"):  # issue 48
        impl = _deterministic(name)
    elif name.partition(":")[0] + ":" in catalog._PREFIXES:
        impl = catalog._PREFIXES[name.partition(":")[0] + ":"][0](name)
    elif ":" in name:
        target, _, attr = name.rpartition(":")
        if not target or not attr:
            raise UnknownImplementationError(f"{name!r} is not NAME, path/to/file.py:Class or package.module:Class")
        impl = _load_file(target, attr, name) if target.endswith(".py") or "/" in target else _load_module(target, attr, name)
    else:
        _load_entry_points()
        if name in catalog._REGISTRY:
            return catalog._REGISTRY[name]
        close = difflib.get_close_matches(name, list(catalog._REGISTRY), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownImplementationError(f"unknown implementation {name!r}{hint} (`attnbench list` shows all)")
    _RESOLVED[key] = impl
    return impl


def _cache_key(name: str) -> str:
    """Resolved names are cached; a relative plug-in path is keyed by the file it points to from here."""
    target, sep, attr = name.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target) and not target.startswith("compiled"):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return name


def names() -> list[str]:
    """Registered names: built-ins first (in registration order), then entry-point plug-ins."""
    _load_builtins()
    _load_entry_points()
    return list(catalog._REGISTRY)


def listed() -> list[str]:
    """What ``attnbench list`` shows: :func:`names`, then the shipped names of each prefix (``hf:``; resolved on demand)."""
    _load_builtins()
    return names() + [n for _, shipped in catalog._PREFIXES.values() for n in shipped()]


def available(device: str = "cpu", dtype: str | None = None) -> list[str]:
    """Registered names that can run on ``device`` (and ``dtype``) here."""
    return [n for n in names() if get(n).unavailable_reason(device, dtype) is None]


def check_adapter(impl: Implementation, spec: AttnSpec) -> None:
    """Build ``impl`` on CPU and resolve its weight adapter (raises :class:`PluginLoadError` if it has none)."""
    adapter_for(impl.build(spec, "cpu", torch.float32))


def resolve(impl, target=None, **given) -> Ready | Skip:
    """:func:`attnbench.resolve.resolve`, with ``impl`` also a name (looked up with :func:`get`)."""
    return _resolve.resolve(get(impl) if isinstance(impl, str) else impl, target, **given)
