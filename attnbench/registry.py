"""The registry of interchangeable multi-head attention implementations.

Built-ins (the ``implementations/`` folder, imported as ``attnbench.implementations``) and plug-ins go
through one path, :func:`register`. A name given anywhere an implementation is accepted resolves as:

* a registered name (``weight_split``, ``sdpa_flash``, ...);
* ``compiled:NAME`` or ``compiled:NAME@MODE``: ``torch.compile`` applied to ``NAME`` as a transform;
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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from packaging.version import Version
from torch import nn

from attnbench import plugins
from attnbench.devices import DTYPES
from attnbench.errors import AttnbenchError, PluginLoadError, UnknownImplementationError
from attnbench.plugins.exits import PluginExit, plugin_exits
from attnbench.resolve import Ready, Skip, resolve, set_name_lookup, variant_skip_reason  # noqa: F401  (re-exported)
from attnbench.spec import QK_NORMS, ROPE_STYLES, AttnSpec
from attnbench.weights import CanonicalWeights, adapter_for, load_weights

ENTRY_POINT_GROUP = "attnbench.implementations"
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ALL_DTYPES = tuple(DTYPES)


@dataclass(frozen=True)
class Implementation:
    """One registered implementation: how to build it, what it is, where it runs."""

    name: str
    factory: Callable[[AttnSpec], nn.Module]
    description: str
    source: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ALL_DTYPES
    backward: tuple[str, ...] = ("cpu", "cuda")  # device types where backward works
    dropout: tuple[str, ...] = ("cpu", "cuda")  # device types where attention dropout is applied
    same_width_only: bool = False
    # Variants (see AttnSpec) the implementation computes; the book's causal MHA is always supported.
    gqa: bool = False  # num_kv_heads < num_heads (grouped-query and multi-query attention)
    sliding_window: bool = False  # spec.window is not None
    non_causal: bool = False  # spec.causal is False
    kv_cache: bool = False  # the KV-cache protocol (forward(x, use_cache=True), reset_cache, rewind_cache)
    # Positional fields of AttnSpec it applies (issue 26); True = all of them, normalised to a tuple.
    rope: bool | tuple[str, ...] = False  # spec.rope_theta/rope_scaling in these rope_style values
    qk_norm: bool | tuple[str, ...] = False  # spec.qk_norm in these placements ("head", "full")
    score_scale: bool = False  # spec.scale (a score scale other than head_dim ** -0.5)
    softcap: bool = False  # spec.softcap (tanh soft-capping of the scores)
    min_torch: str = "2.0"
    sdpa_backend: str | None = None  # flash | efficient | cudnn: the SDPA backend it forces (asked of PyTorch on CUDA)
    probe: Callable[[torch.device], str | None] | None = field(default=None, compare=False)
    transform: Callable[[nn.Module], nn.Module] | None = field(default=None, compare=False)
    origin: str = "builtin"

    def __post_init__(self) -> None:  # accept plain booleans from plug-ins: True = everywhere it runs
        for name in ("backward", "dropout"):
            value = getattr(self, name)
            if isinstance(value, bool):
                object.__setattr__(self, name, tuple(self.devices) if value else ())
        for name, every in (("rope", ROPE_STYLES), ("qk_norm", QK_NORMS)):
            value = getattr(self, name)
            if isinstance(value, bool):
                value = tuple(every) if value else ()
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))

    def supports_backward(self, device: str | torch.device) -> bool:
        """Whether gradients can be taken on ``device``'s type."""
        return torch.device(device).type in self.backward

    def supports_dropout(self, device: str | torch.device) -> bool:
        """Whether attention dropout is applied in train mode on ``device``'s type."""
        return torch.device(device).type in self.dropout

    def unavailable_reason(self, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> str | None:
        """Why this implementation cannot run on ``device``/``dtype`` here, or ``None`` when it can
        (:func:`attnbench.resolve.resolve` without sizes or mode)."""
        return resolve(self, device=device, dtype=dtype).reason

    def build(self, spec: AttnSpec, device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32,
              weights: CanonicalWeights | None = None, ready: Ready | None = None) -> nn.Module:
        """Construct for ``spec`` on ``device`` in ``dtype``, load ``weights`` if given, apply the transform.

        Raises :class:`UnavailableError` when it cannot run there (:func:`attnbench.resolve.resolve`; a
        caller that resolved already passes its ``ready`` answer, whose device and dtype are used) and
        :class:`PluginLoadError` when the constructor fails.
        """
        outcome = ready or resolve(self, spec, device=device, dtype=dtype)
        if isinstance(outcome, Skip):
            raise outcome.exception()
        try:
            with plugin_exits(f"{self.name}'s constructor"):
                module = self.factory(spec)
        except AttnbenchError:
            raise
        except Exception as exc:  # a plug-in's constructor: name it and say what failed
            raise PluginLoadError(f"{self.name} failed to build for {spec}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(module, nn.Module):
            raise PluginLoadError(f"{self.name}'s factory returned {type(module).__name__}, not an nn.Module")
        module = module.to(device=outcome.device, dtype=outcome.dtype)
        if weights is not None:
            load_weights(module, weights, spec)
        if self.transform is not None:
            module = self.transform(module)
        return module


_REGISTRY: dict[str, Implementation] = {}
_PREFIXES: dict[str, tuple[Callable[[str], Implementation], Callable[[], list[str]]]] = {}
_RESOLVED: dict[str, Implementation] = {}
_LOADED = {"builtins": False, "entry_points": False}


def register(name: str, factory: Callable[[AttnSpec], nn.Module] | None = None, **info) -> Callable:
    """Register an implementation under ``name``; usable as ``register("x", factory, ...)`` or as a class decorator.

    ``info`` takes the :class:`Implementation` fields (``description``, ``source``, ``devices``, ...).
    A class is called with the spec's keyword arguments (the book's constructor).
    """

    def add(obj):
        fac = _class_factory(obj) if inspect.isclass(obj) else obj
        doc = info.pop("description", None) or _first_line(obj)
        _REGISTRY[name] = Implementation(name=name, factory=fac, description=doc,
                                         source=info.pop("source", ""), **info)
        _RESOLVED.clear()
        return obj

    return add(factory) if factory is not None else add


def unregister(name: str) -> None:
    """Remove ``name`` (for tests and plug-in reloads)."""
    _REGISTRY.pop(name, None)
    _RESOLVED.clear()


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else getattr(obj, "__name__", str(obj))


def _class_factory(cls) -> Callable[[AttnSpec], nn.Module]:
    def factory(spec: AttnSpec) -> nn.Module:
        # The book's constructor, plus the variant and positional fields (num_kv_heads, window, causal; rope_theta,
        # qk_norm, scale, ...) by name when they differ from the defaults: a class declares such a capability only
        # if its constructor takes them.
        return cls(spec.d_in, spec.d_out, spec.context_length, spec.dropout, spec.num_heads, qkv_bias=spec.qkv_bias,
                   **spec.variant_kwargs(), **spec.positional_kwargs())

    factory.__name__ = f"{cls.__name__}_factory"
    return factory


def _load_builtins() -> None:
    if not _LOADED["builtins"]:
        _LOADED["builtins"] = True
        importlib.import_module("attnbench.implementations")


def _load_entry_points() -> None:
    if _LOADED["entry_points"]:
        return
    _LOADED["entry_points"] = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            _REGISTRY[ep.name] = _from_object(ep.name, ep.load(), source=ep.value, origin="entry-point")
        except Exception as exc:  # a broken plug-in must not hide the others: list it as unavailable
            reason = f"entry point {ep.value} failed to load: {type(exc).__name__}: {exc}"
            _REGISTRY[ep.name] = Implementation(name=ep.name, factory=_raiser(reason), description=reason,
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
    try:
        with plugin_exits(f"importing {mod_path!r}"):
            module = importlib.import_module(mod_path)
    except PluginExit as exc:
        raise PluginLoadError(str(exc)) from None
    except ModuleNotFoundError as exc:
        raise PluginLoadError(f"module {mod_path!r} not found ({exc}); install it or add its folder to PYTHONPATH") from exc
    except Exception as exc:
        raise PluginLoadError(f"importing {mod_path!r} failed: {type(exc).__name__}: {exc}") from exc
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


def get(name: str) -> Implementation:
    """The :class:`Implementation` called ``name`` (see the module docstring for the accepted forms)."""
    display, name = plugins.split_display_name(name)
    if display is not None:  # NAME=target: the target under a short name for tables, figures and reports
        return replace(get(name), name=display)
    key = _cache_key(name)
    if key in _RESOLVED:
        return _RESOLVED[key]
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name.startswith("compiled:"):
        impl = _compiled(name)
    elif name.partition(":")[0] + ":" in _PREFIXES:
        impl = _PREFIXES[name.partition(":")[0] + ":"][0](name)
    elif ":" in name:
        target, _, attr = name.rpartition(":")
        if not target or not attr:
            raise UnknownImplementationError(f"{name!r} is not NAME, path/to/file.py:Class or package.module:Class")
        impl = _load_file(target, attr, name) if target.endswith(".py") or "/" in target else _load_module(target, attr, name)
    else:
        _load_entry_points()
        if name in _REGISTRY:
            return _REGISTRY[name]
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.5)
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
    return list(_REGISTRY)


def register_prefix(prefix: str, resolve_name: Callable[[str], Implementation], shipped: Callable[[], list[str]]) -> None:
    """Names starting with ``prefix`` (``"hf:"``) are resolved on demand by ``resolve_name(name)``; ``shipped()`` lists
    the ones ``attnbench list`` shows. Called by the implementation module that owns the prefix when the built-ins
    load (``implementations/hf.py``), so the registry needs no import of it."""
    _PREFIXES[prefix] = (resolve_name, shipped)
    _RESOLVED.clear()


def listed() -> list[str]:
    """What ``attnbench list`` shows: :func:`names`, then the shipped names of each prefix (``hf:``; resolved on demand)."""
    _load_builtins()
    return names() + [n for _, shipped in _PREFIXES.values() for n in shipped()]


def available(device: str = "cpu", dtype: str | None = None) -> list[str]:
    """Registered names that can run on ``device`` (and ``dtype``) here."""
    return [n for n in names() if get(n).unavailable_reason(device, dtype) is None]


def check_adapter(impl: Implementation, spec: AttnSpec) -> None:
    """Build ``impl`` on CPU and resolve its weight adapter (raises :class:`PluginLoadError` if it has none)."""
    adapter_for(impl.build(spec, "cpu", torch.float32))


set_name_lookup(get)  # resolve() accepts names: looked up here, without resolve importing this module
