"""The catalog of implementations: :class:`Implementation`, and :func:`register` / :func:`register_prefix`, which
fill it. The built-ins (``implementations/``) register here; :mod:`attnbench.registry` loads them and looks names up
(``get``, ``names``, ``compiled:``, plug-ins), so that the implementations never import the module that imports them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnbench.correctness.masks import KINDS as MASK_KINDS
from attnbench.devices import DTYPES
from attnbench.errors import AttnbenchError, CellTimeout, PluginLoadError
from attnbench.plugins.exits import plugin_exits
from attnbench.resolve import Ready, Skip, resolve
from attnbench.spec import QK_NORMS, ROPE_STYLES, AttnSpec
from attnbench.weights import CanonicalWeights, fit_gains, load_weights

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
    varlen: bool = False  # issue 37: takes variable-length batches, forward(x, lengths=..., prepared=None) (only those)
    # Positional fields of AttnSpec it applies (issue 26); True = all of them, normalised to a tuple.
    rope: bool | tuple[str, ...] = False  # spec.rope_theta/rope_scaling in these rope_style values
    qk_norm: bool | tuple[str, ...] = False  # spec.qk_norm in these placements ("head", "full")
    score_scale: bool = False  # spec.scale (a score scale other than head_dim ** -0.5)
    softcap: bool = False  # spec.softcap (tanh soft-capping of the scores)
    rope_partial: bool = False  # spec.rope_head_dim (RoPE over the first rope_head_dim dims of each head only)
    # Issue 37: the masks of attnbench.correctness.masks.KINDS it computes (alibi, prefix, document, sink); True = all of them
    masks: bool | tuple[str, ...] = ()
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
        for name, every in (("rope", ROPE_STYLES), ("qk_norm", QK_NORMS), ("masks", MASK_KINDS)):
            value = getattr(self, name)
            if isinstance(value, bool):
                value = tuple(every) if value else ()
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        unknown = sorted(set(self.masks) - set(MASK_KINDS))
        if unknown:
            raise PluginLoadError(f"{self.name} declares masks {unknown}; the masks are {', '.join(MASK_KINDS)} "
                                  "(causal, window and softcap have their own capabilities)")

    def supports_backward(self, device: str | torch.device) -> bool:
        """Whether gradients can be taken on ``device``'s type."""
        return torch.device(device).type in self.backward

    def supports_dropout(self, device: str | torch.device) -> bool:
        """Whether attention dropout is applied in train mode on ``device``'s type."""
        return torch.device(device).type in self.dropout

    def own_spec(self, spec: AttnSpec) -> AttnSpec:
        """``spec`` as this implementation computes it: a user's class that always applies QK-norm or RoPE, or keeps
        its own norm epsilon, gets them filled in (``PluginFactory.own_spec``); raises
        :class:`~attnbench.errors.UnavailableError` for a spec the class cannot take (an odd head dim where it always
        rotates). Built-ins take every spec as it is."""
        own = getattr(self.factory, "own_spec", None)
        return own(spec, self.qk_norm) if own is not None else spec

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
        spec = self.own_spec(spec)
        outcome = ready or resolve(self, spec, device=device, dtype=dtype)
        if isinstance(outcome, Skip):
            raise outcome.exception()
        if weights is not None:
            weights = fit_gains(weights, spec)
        try:
            with plugin_exits(f"{self.name}'s constructor"):
                module = self.factory(spec)
        except (AttnbenchError, CellTimeout):  # a constructor that runs forward (a binding probe) can time out
            raise
        except Exception as exc:  # a plug-in's constructor: name it and say what failed
            raise PluginLoadError(f"{self.name} failed to build for {spec}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(module, nn.Module):
            raise PluginLoadError(f"{self.name}'s factory returned {type(module).__name__}, not an nn.Module")
        module = _moved(module, outcome.device, outcome.dtype)
        if weights is not None:
            load_weights(module, weights, spec)
        if self.transform is not None:
            module = self.transform(module)
        return module


def _moved(module: nn.Module, device, dtype) -> nn.Module:
    """``module`` on ``device`` in ``dtype``, its complex buffers (Meta-style ``freqs_cis`` tables a class registers)
    moved but kept complex: ``Module.to(float64)`` would cast them to real and drop their imaginary part, which no
    caller of such a class does (it builds the class in the dtype, or moves it with ``.to(device)``)."""
    held = [(owner, leaf, t) for name, t in module.named_buffers() if t is not None and t.is_complex()
            for owner, leaf in [(module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])]]
    for owner, leaf, _ in held:
        owner._buffers[leaf] = None
    module = module.to(device=device, dtype=dtype)
    for owner, leaf, t in held:
        owner._buffers[leaf] = t.to(device)
    return module


_REGISTRY: dict[str, Implementation] = {}
_PREFIXES: dict[str, tuple[Callable[[str], Implementation], Callable[[], list[str]]]] = {}


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
        _changed()
        return obj

    return add(factory) if factory is not None else add


def unregister(name: str) -> None:
    """Remove ``name`` (for tests and plug-in reloads)."""
    _REGISTRY.pop(name, None)
    _changed()


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


def register_prefix(prefix: str, resolve_name: Callable[[str], Implementation], shipped: Callable[[], list[str]]) -> None:
    """Names starting with ``prefix`` (``"hf:"``) are resolved on demand by ``resolve_name(name)``; ``shipped()`` lists
    the ones ``attnbench list`` shows. Called by the implementation module that owns the prefix when the built-ins
    load (``implementations/hf.py``), so the registry needs no import of it."""
    _PREFIXES[prefix] = (resolve_name, shipped)
    _changed()


_CHANGED: list[Callable[[], None]] = []
"""Called when the catalog changes (the registry forgets the names it resolved)."""


def _changed() -> None:
    for hook in _CHANGED:
        hook()
