"""Calling a user's constructor with the spec: by parameter name, with the aliases common codebases use.

``MyAttention(d_model, n_heads, block_size, attn_pdrop, bias)``, ``MHA(d_in, d_out, num_heads,
context_length, dropout, qkv_bias)`` and ``CausalSelfAttention(config)`` are all built from the same
:class:`~attnbench.spec.AttnSpec`. Arguments are passed by position (the book's order) only when no
parameter name says what it is.
"""

from __future__ import annotations

import enum
import inspect
import linecache
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from attnbench.errors import PluginLoadError, UnavailableError
from attnbench.plugins import signatures
from attnbench.plugins.aliases import ALIASES, spec_values
from attnbench.plugins.aliases import BY_NAME as _BY_NAME
from attnbench.plugins.config_guess import ADDON_WORDS
from attnbench.plugins.outputs import output_first
from attnbench.spec import AttnSpec

RESIDUAL_DROPOUT = ("resid_pdrop", "resid_dropout", "residual_dropout", "hidden_dropout_prob", "hidden_dropout",
                    "proj_drop", "proj_dropout", "resid_drop", "output_dropout", "out_dropout")
"""Names of a separate residual/output dropout: they get 0.0, because the canonical layer's only dropout
is on the attention weights (a single field that sets both, like nanoGPT's ``dropout``, gets the spec's)."""

INDEX_NAMES = ("layer_idx", "block_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_index",
               "idx", "index")
"""A constructor's layer index (``Attention(config, layer_idx)``): attnbench builds one layer, index 0."""
PROJECTIONS = {"q_proj": "q", "query": "q", "W_query": "q", "wq": "q", "q_layer": "q",
               "k_proj": "kv", "key": "kv", "W_key": "kv", "wk": "kv", "k_layer": "kv",
               "v_proj": "kv", "value": "kv", "W_value": "kv", "wv": "kv", "v_layer": "kv",
               "o_proj": "out", "out_proj": "out", "output_proj": "out", "wo": "out", "c_proj": "out"}
"""Constructor parameters that take a projection module (``Attention(config, q_proj: nn.Module, ...)``), by role:
each gets an ``nn.Linear`` built from the spec (queries ``d_in -> d_out``, keys and values ``d_in -> kv heads x
head_dim``, both with the spec's ``qkv_bias``; the output ``d_out -> d_out`` with a bias, as the book's)."""
CONFIG_NAMES = ("config", "cfg", "conf", "args", "hparams", "params", "model_args", "hp", "settings", "opt")
_BOOK_ORDER = ("d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias")
_CAPABILITY_KEYS = ("description", "source", "devices", "dtypes", "backward", "dropout", "same_width_only",
                    "min_torch", "gqa", "sliding_window", "non_causal", "kv_cache",
                    "rope", "qk_norm", "score_scale", "softcap", "rope_partial", "masks", "varlen", "qkv_bias")
WINDOW_EVIDENCE = ("window", "sliding_window", "sliding_window_size", "attention_window")
"""Names that say a class computes sliding-window attention (a bare ``window_size`` does not)."""
GUIDE = "docs/own-attention.md: Bring your own attention"
PROBE = AttnSpec(d_in=20, d_out=24, context_length=9, dropout=0.0, num_heads=4)
"""d_in, d_out, 3*d_out, head_dim and num_heads all differ, so each shape says what it is."""
SQUARE_PROBE = AttnSpec(d_in=24, d_out=24, context_length=9, dropout=0.0, num_heads=4)
"""For constructors that take one width (``embed_dim``, ``n_embd``, a config): d_in == d_out."""


def _asked_with_default(frame) -> bool:
    """Whether the line that reads a config field reads it with a fallback (``getattr(config, "f", 1.0)``,
    ``hasattr``): the class's own default then stands, and nothing is guessed."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return "getattr(" in line or "hasattr(" in line


class SpecConfig(dict):
    """The config object a ``CausalSelfAttention(config)``-style constructor receives.

    It carries every alias of every spec field, so nanoGPT (``n_embd, n_head, block_size, dropout,
    bias``), minGPT (``attn_pdrop, resid_pdrop``) and Hugging Face names (``hidden_size,
    num_attention_heads, attention_dropout, max_position_embeddings``) all read as attributes or keys. A field
    read under a prefix of a larger config's part (nanoVLM's ``cfg.lm_n_heads``, ``cfg.lm_hidden_dim``) is the
    alias its longest tail names (``n_heads``, ``dim``); ``check -v`` lists those it read so.
    """

    def __getattr__(self, name: str):
        if dict.__contains__(self, name):
            return self[name]
        alias = self._suffix(name)
        if alias is not None:  # a config of several parts: lm_n_heads, vit_dropout, text_hidden_size
            self.__dict__.setdefault("_attnbench_suffixed", {})[name] = alias
            return self[alias]
        if self.__dict__.get("_attnbench_target") is not None and not _asked_with_default(sys._getframe(1)):
            return self._guess(name)
        raise AttributeError(f"{CONFIG_FIELD} {name!r} (it has the aliases of d_in, "
                             f"d_out, num_heads, context_length, dropout, qkv_bias and head_dim; {GUIDE})") from None

    def _suffix(self, name: str) -> str | None:
        """The longest ``_``-separated tail of ``name`` (of two letters or more) that is a field here, or None."""
        parts = name.split("_")
        if parts[0].lower() in ADDON_WORDS:  # lora_attn_dim is the adapter's rank, not the width: guessed off
            return None
        for i in range(1, len(parts)):
            tail = "_".join(parts[i:])
            if len(tail) > 1 and dict.__contains__(self, tail):
                return tail
        return None

    def __setattr__(self, name: str, value) -> None:
        self[name] = value

    def __getitem__(self, name):
        if not isinstance(name, str):
            raise KeyError(name)
        read = self.__dict__.get("_attnbench_read")
        if read is not None and name not in read:
            read.append(name)  # what the class reads is what it supports (plugins.inference)
        if not dict.__contains__(self, name) and self.__dict__.get("_attnbench_target") is not None:
            alias = self._suffix(name)  # cfg["lm_n_heads"]: the alias its longest tail names, as an attribute's
            return self[alias] if alias is not None else self._guess(name)  # a key no spec field fills
        return super().__getitem__(name)

    def role_value(self, role: str):
        """The value of spec field ``role`` this config carries (under its first alias)."""
        return self[ALIASES[role][0]]

    def _guess(self, name: str):
        """A field no spec field fills, guessed from its class's source (:mod:`~attnbench.plugins.config_guess`)."""
        from attnbench.plugins import config_guess

        target = self.__dict__["_attnbench_target"]
        value, why = config_guess.guess(target, name, self)
        config_guess.GUESSED.setdefault(target, {})[name] = (value, why)
        return value

    def get(self, name, default=None):
        return self[name] if name in self else default

    @classmethod
    def for_spec(cls, spec: AttnSpec) -> SpecConfig:
        """The config for ``spec``: every alias set to its field's value, separate residual dropouts 0.0."""
        values = spec_values(spec)
        config = cls({alias: values[field] for alias, field in _BY_NAME.items()})
        config.update(dict.fromkeys(RESIDUAL_DROPOUT, 0.0))
        config.update(is_causal=spec.causal, causal=spec.causal, rope_scaling=hf_rope_scaling(spec))
        return config


def hf_rope_scaling(spec: AttnSpec) -> dict | None:
    """``spec.rope_scaling`` as a Hugging Face config carries it (``{"rope_type": "llama3", "factor": ...}``), or None."""
    s = getattr(spec, "rope_scaling", None)
    if s is None:
        return None
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_context_length}


@dataclass(frozen=True)
class Binding:
    """How a constructor is called: ``style`` is ``keywords``, ``config``, ``positional`` or ``spec`` (a factory)."""

    target: Callable
    style: str
    params: tuple[tuple[str, str], ...] = ()  # (parameter, spec field or "residual_dropout")
    config_param: str = ""
    extras: tuple[tuple[str, object], ...] = ()  # fixed arguments: a layer index (INDEX_NAMES) gets 0
    config_factory: Callable | None = None  # spec -> the class's own config object (plugins.configs); else SpecConfig
    config_note: str = ""  # how that config is filled, for check -v
    modules: tuple[tuple[str, str], ...] = ()  # (parameter, PROJECTIONS role): an nn.Linear built from the spec
    notes: tuple[str, ...] = ()  # how roles no name gave were decided (plugins.roles), for check -v
    causal_flags: tuple[tuple[str, bool], ...] = ()  # (parameter, its value for causal attention), found by a probe
    cast: str = ""  # the dtype the class builds its weights in when not the default's: cast as a whole (plugins.stages)
    channels_first: bool = False  # projections are pointwise Conv1d on (B, C, T): checked as (B, T, C) (plugins.channels_first)
    probe_theta: float | None = None  # a class that builds only with a rotary base (EAGLE's tables): its probes' theta
    encoder: bool = False  # not causal and not meant to be: checked non-causal (plugins.encoder)
    time_first: bool = False  # its forward takes (T, B, C): checked as (B, T, C) (plugins.time_first)
    one_width: bool = False  # its roles fit multi-head attention only where d_in == d_out (plugins.roles)

    def make_config(self, spec: AttnSpec):
        """The config object the constructor receives for ``spec``."""
        if self.config_factory is not None:
            return self.config_factory(spec)
        config = SpecConfig.for_spec(spec)
        config.__dict__["_attnbench_target"] = self.target  # a field it lacks is guessed (plugins.config_guess)
        return config

    @property
    def fields(self) -> set[str]:
        """Spec fields the constructor receives."""
        if self.style in ("config", "positional", "spec"):
            return set(_BOOK_ORDER)
        return {f for _, f in self.params}

    @property
    def same_width_only(self) -> bool:
        """True when the constructor takes one width (``embed_dim``, ``n_embd``, a config): d_in == d_out only."""
        if self.style == "config" or self.one_width:
            return True
        if self.style == "spec":  # an adapter says so in its capabilities (plugins.adapt)
            return bool((getattr(self.target, "attnbench_capabilities", None) or {}).get("same_width_only"))
        return self.style == "keywords" and len({"d_in", "d_out"} & self.fields) == 1

    @property
    def probe(self) -> AttnSpec:
        """The spec the class is probed at: :data:`PROBE`, or :data:`SQUARE_PROBE` when it takes one width."""
        base = SQUARE_PROBE if self.same_width_only else PROBE
        return base if self.probe_theta is None else replace(base, rope_theta=self.probe_theta)

    def __call__(self, spec: AttnSpec) -> nn.Module:
        module = self._build(spec)
        if isinstance(module, nn.Module):
            initialised(module, self.target)
            module.register_forward_hook(output_first, with_kwargs=True)
        if self.cast and isinstance(module, nn.Module):  # built in bfloat16 (a class attribute, .half()): as a whole
            module = module.to(torch.get_default_dtype())
        if self.channels_first and isinstance(module, nn.Module):
            from attnbench.plugins.channels_first import as_channels_last

            module = as_channels_last(module, spec.d_in)
        if self.time_first and isinstance(module, nn.Module):
            from attnbench.plugins.time_first import as_batch_first

            module = as_batch_first(module, spec.d_in)
        return module

    def _build(self, spec: AttnSpec) -> nn.Module:
        values = spec_values(spec)
        flags = {p: v if spec.causal else not v for p, v in self.causal_flags}
        if self.style == "spec":
            return self.target(spec)
        if self.style == "config":
            return self.target(**{self.config_param: self.make_config(spec)}, **fixed(self.extras),
                               **projections(self.modules, values), **flags)
        if self.style == "positional":
            args = [values[f] for f in _BOOK_ORDER]
            return self.target(*args[:-1], qkv_bias=args[-1]) if self._takes_qkv_keyword() else self.target(*args)
        width = values["d_out"] if "d_out" in self.fields and "d_in" not in self.fields else values["d_in"]
        kwargs = {}
        for param, field in self.params:
            kwargs[param] = 0.0 if field == "residual_dropout" else width if field == "d_in" else \
                self.make_config(spec) if field == "config" else values[field]
            if field == "window" and kwargs[param] is None and param in self._required():
                kwargs[param] = values["context_length"]  # required, no window: one over every position (causal)
            if isinstance(kwargs[param], str | type(None)):
                kwargs[param] = _in_choices(self.target, param, kwargs[param])
            if field == "dropout" and param in dropout_modules(self.target):
                kwargs[param] = nn.Dropout(kwargs[param])  # DI-engine's `dropout: nn.Module`
        return self.target(**kwargs, **fixed(self.extras), **projections(self.modules, values), **flags)

    def _required(self) -> set[str]:
        """The constructor's parameters without a default."""
        return {p.name for p in _signature(self.target).parameters.values() if p.default is p.empty}

    def _takes_qkv_keyword(self) -> bool:
        params = _signature(self.target).parameters.values()
        return any(p.kind == p.VAR_KEYWORD or p.name == "qkv_bias" for p in params)

    def describe(self) -> str:
        """``MHA(d_model=d_in, n_heads=num_heads, ...)``, for ``attnbench check -v``, with the config fields guessed."""
        from attnbench.plugins.config_guess import note

        guessed = note(self.target)
        empty = sorted(UNINITIALISED.get(self.target, ()))
        guessed += ("; " if guessed and empty else "") + (f"left uninitialised by its constructor, given random values "
                                                         f"for the probes: {', '.join(empty)}" if empty else "")
        return self._describe() + (f" ({guessed})" if guessed else "")

    def _describe(self) -> str:
        name = getattr(self.target, "__qualname__", repr(self.target))
        if self.style == "spec":
            return f"{name}(spec)"
        extras = "".join(f", {p}={v!r}" for p, v in self.extras)
        chosen = [p for p, v in self.extras  # a bool: a probe's, noted; a float: held (roles); a placement: the case's
                  if p not in INDEX_NAMES and not isinstance(v, (bool, float, Placement))]
        notes = (["one layer is built: its index is 0"] if any(p in INDEX_NAMES for p, _ in self.extras) else []) + \
            ([f"{', '.join(chosen)}: the first plain member of its choices"] if chosen else [])
        extras += f" ({'; '.join(notes)})" if notes else ""
        extras += "".join(f", {p}=nn.Linear({PROJECTION_WORDS[r]})" for p, r in self.modules)
        if self.style == "config":
            config = self.config_note or "<config with n_embd, n_head, block_size, dropout, bias, ...>"
            return f"{name}({self.config_param}={config}{extras})"
        if self.style == "positional":
            return f"{name}({', '.join(_BOOK_ORDER)}) by position"
        windows = [p for p, f in self.params if f == "window" and p in self._required()]
        notes = [*self.notes, *(f"{p}: the context length when the spec has no window (a window over every position)"
                                for p in windows)]
        notes = f" ({'; '.join(notes)})" if notes else ""
        extras += "".join(f", {p}=<{v} when causal, {not v} when not>" for p, v in self.causal_flags)
        return f"{name}({', '.join(f'{p}={f}' for p, f in self.params)}{extras}){notes}"


UNINITIALISED: dict = {}
"""Constructor -> the weight matrices it left uninitialised (``torch.empty``), for ``check -v``."""


def dropout_modules(target) -> set[str]:
    """The constructor parameters of ``target`` named as a dropout and annotated as a module (DI-engine's
    ``Attention(..., dropout: nn.Module)``): given ``nn.Dropout`` of the spec's rate, not the rate."""
    try:
        params = _signature(target).parameters.values()
    except PluginLoadError:
        return set()
    return {p.name for p in params if p.name in ALIASES["dropout"]
            and any(w in str(p.annotation) for w in ("Module", "Dropout"))}


def _in_choices(target, param: str, value):
    """``value`` for a parameter that takes strings of its own (stable-audio's ``qk_norm: Literal['l2', 'ln', 'none'] =
    'none'``): the spec's ``None`` is its default, a string its choices lack is a spec it cannot take."""
    p = _signature(target).parameters.get(param)
    if p is None or not isinstance(p.default, str):
        return value
    choices = typing.get_args(p.annotation) if typing.get_origin(p.annotation) is typing.Literal else ()
    if value is None:
        return p.default
    if choices and value not in choices:
        raise UnavailableError(f"{getattr(target, '__qualname__', target)} takes {param} in {list(choices)}, not "
                               f"{value!r} (the class's own constraint)")
    return value


def initialised(module: nn.Module, target) -> None:
    """Give random values to the weight matrices ``module``'s constructor left uninitialised (TransformerLens's
    ``nn.Parameter(torch.empty(...))``, initialised by the whole model): non-finite or huge, and then also those all
    zero (biases aside); a vector left so gets ones (zeros for a bias: TimesFM's per-dimension query scale). Probes read
    outputs, and garbage weights give none; every case loads its own weights. Nothing is touched in a class whose
    weights are all finite and moderate."""
    matrices = {n: p for n, p in module.named_parameters()
                if p.dim() >= 2 and p.numel() and p.dtype.is_floating_point and p.device.type != "meta"}
    with torch.no_grad():
        garbage = {n for n, p in matrices.items() if not bool(torch.isfinite(p).all()) or float(p.abs().max()) > 1e6}
        empty = {n for n, p in matrices.items() if garbage and not p.any()
                 and not re.search(r"(^|[._])(b|bias)(_|$)", n)}
        g = torch.Generator().manual_seed(0)
        for name in sorted(garbage | empty):  # torch.empty gives zeros too, where the memory was fresh
            p = matrices[name]
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / max(p.shape[-2:]) ** 0.5)
        vectors = {n: p for n, p in module.named_parameters() if p.dim() == 1 and p.numel() and p.dtype.is_floating_point
                   and p.device.type != "meta" and (not bool(torch.isfinite(p).all()) or float(p.abs().max()) > 1e6)}
        for name, p in vectors.items():  # a bias gets zeros, anything else (a gain, a per-dimension scale) ones
            p.fill_(0.0 if re.search(r"(^|[._])(b|bias)(_|$)", name) else 1.0)
    if garbage or vectors:
        UNINITIALISED.setdefault(target, set()).update(garbage | empty | set(vectors))


def _signature(target) -> inspect.Signature:
    try:
        return signatures.signature(target)
    except (TypeError, ValueError) as exc:
        raise PluginLoadError(f"cannot read the signature of {target!r} ({exc}); point --impl at a factory "
                              f"make_attention(spec) instead ({GUIDE})") from exc


def _is_config_name(name: str) -> bool:
    return name in CONFIG_NAMES or name.endswith(("config", "cfg"))


def bind(target: Callable) -> Binding:
    """How to call ``target`` (a class, or a factory function) with a spec; raises :class:`PluginLoadError`
    when a required parameter is neither a known name nor fillable by position, or ``target`` is a class that is no
    ``torch.nn.Module`` (a NumPy model's ``Module`` of its own): its first true cause, before its arguments'."""
    if inspect.isclass(target) and not issubclass(target, nn.Module):
        bases = ", ".join(b.__qualname__ for b in target.__mro__[1:-1]) or "object"
        raise PluginLoadError(f"{target.__qualname__} is not a torch.nn.Module (it derives from {bases}): attnbench "
                              "checks PyTorch attention layers", fix="point it at a torch.nn.Module class, or a function "
                                                              "that returns one")
    sig = _signature(target)
    named = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    extras = tuple((p.name, 0) for p in named if p.name in INDEX_NAMES and p.default is p.empty)
    extras += choice_extras(target, [p for p in named if p.default is p.empty and p.name not in _BY_NAME])
    extras += tuple((p.name, PLACEMENT[_placement(p)]) for p in named if p.default is p.empty and _placement(p))
    modules = tuple((p.name, PROJECTIONS[p.name]) for p in named if p.name in PROJECTIONS and p.default is p.empty)
    named = [p for p in named if p.name not in dict(extras) and p.name not in dict(modules)]
    required = [p for p in named if p.default is p.empty]
    known = [(p.name, _BY_NAME[p.name]) for p in named if p.name in _BY_NAME]
    known += [(p.name, "residual_dropout") for p in named if p.name in RESIDUAL_DROPOUT]
    if len(required) > 1:  # a config beside other arguments (GPT-1's Attention(nx, n_ctx, cfg, scale)): SpecConfig
        known += [(p.name, "config") for p in required if p.name not in _BY_NAME and _is_config_name(p.name)]
    if not inspect.isclass(target) and len(named) >= 1 and (named[0].name == "spec" or (len(required) <= 1 and not known)):
        return Binding(target, "spec")
    if inspect.isclass(target) and [p.name for p in required] == ["spec"]:  # the adapter protocol (plugins.adapt)
        return Binding(target, "spec")
    if len(required) == 1 and required[0].name not in _BY_NAME and _is_config_name(required[0].name):
        # a config alone is required (known names beside it are optional: happy-llm's (args: ModelArgs, is_causal=False))
        return Binding(target, "config", config_param=required[0].name, extras=extras, modules=modules)
    if not known or (required and not any(p.name in dict(known) for p in required)):
        if modules:
            raise PluginLoadError(f"{getattr(target, '__qualname__', target)} takes projection modules "
                                  f"({', '.join(dict(modules))}) but no parameter says its width and heads; give it a "
                                  f"config or named widths, or point --impl at a factory make_attention(spec) ({GUIDE})")
        positional = Binding(target, "positional")  # the book's order: kept when the class builds with it
        if not required or _builds(positional):
            return positional
        solved = _by_roles(target, required, known, extras, modules)
        if solved is None:  # a role assignment that reached CUDA: that, not the book's order's TypeError
            _refuse_setup(target, ", ".join(repr(p.name) for p in required))
        return solved or positional  # nothing fits: its construction failure is the first cause (inference.py)
    unknown = [p for p in required if p.name not in dict(known)]
    if unknown:
        from attnbench.plugins.roles import solvable

        solved = _by_roles(target, unknown, known, extras, modules) if all(map(solvable, unknown)) else None
        if solved is not None:
            return solved
        _refuse_unknown(target, named, unknown)
    plain = Binding(target, "keywords", params=tuple(known), extras=extras, modules=modules)
    return _optional_sizes(plain, [p for p in named if p.name not in dict(known)]) or plain


def _optional_sizes(plain: Binding, optional: list[inspect.Parameter]) -> Binding | None:
    """Roles for optional parameters with int defaults whose names attnbench does not know (sockeye's
    ``MultiHeadSelfAttention(depth_att=512, heads=8, depth_out=512, ...)``), decided by probes, when the class built
    with its known names alone does not hold multi-head attention's weights at the probes' sizes; None otherwise."""
    from attnbench.plugins.roles import fits_probes

    sizes = [p for p in optional if type(p.default) is int and p.default > 1]
    if not sizes or fits_probes(plain):
        return None
    return _by_roles(plain.target, sizes, list(plain.params), plain.extras, plain.modules)


CONFIG_FIELD = "the config attnbench passes has no field"
TRIED: dict = {}
"""Constructor -> what each role assignment tried raised, when none built (for :func:`_refuse_unknown`)."""


def _refuse_unknown(target, named, unknown) -> None:
    """One refusal naming the constructor parameters no role fits: those a probe cannot decide (a ``str``, a tuple, a
    module) when there are any, since nothing can be built without them; else every unknown one."""
    from attnbench.plugins.roles import solvable

    blocking = [p for p in unknown if not solvable(p)] or unknown
    shown = ", ".join(p.name for p in named)
    what = ", ".join(repr(p.name) + ("" if p.annotation is p.empty else f" ({getattr(p.annotation, '__name__', p.annotation)})")
                     for p in blocking)
    why = "a probe cannot choose a value of its type" if blocking is not unknown else \
        "no name attnbench knows, and no assignment of width, heads, kv heads, head dim, context length, dropout or " \
        "bias built a class of multi-head attention's size"
    if blocking is unknown:
        _refuse_setup(target, what)
    tried = TRIED.pop(target, [])
    raised = [e.split(": ", 1)[1] for e in tried if ": " in e and ": built, but " not in e]
    built = [e.split(": built, but ", 1) for e in tried if ": built, but " in e]
    if blocking is unknown and built:  # it builds, but holds more than attention: that is the first cause
        why += f" (with {built[0][0]} it builds, but {built[0][1]})"
    elif blocking is unknown and raised and len(set(raised)) == 1:  # every assignment failed alike
        why += f" (every assignment tried raised {raised[0]})"
    raise PluginLoadError(
        f"cannot call {getattr(target, '__qualname__', target)}({shown}): attnbench does not know what to pass for "
        f"{what}: {why}; give {'them defaults' if len(blocking) > 1 else 'it a default'}, or run `attnbench adapt "
        f"FILE:Class`, which writes an adapter with a TODO for each ({GUIDE})")


CUDA_WORDS = ("cuda", "nvidia driver", "nccl")
DISTRIBUTED_WORDS = ("model parallel", "model_parallel", "process group", "process_group", "torch.distributed",
                     "init_process_group")
"""Words of an error that say a constructor needs CUDA, or a distributed setup (plugins.inference too)."""


def _refuse_setup(target, what: str) -> None:
    """Refuse ``target`` for the setup (CUDA, a distributed group) a role assignment reached (:data:`TRIED`): an
    assignment that got that far got past the arguments the others stopped at, so that is the first cause."""
    raised = [e.split(": ", 1)[1] for e in TRIED.get(target, []) if ": " in e and ": built, but " not in e]
    setup, said = _needs_setup(raised)
    if setup:
        every = "every assignment" if len(set(raised)) == 1 else "an assignment"
        raise PluginLoadError(f"{getattr(target, '__qualname__', target)} cannot be built on this machine: it needs "
                              f"{setup} ({every} of {what} tried raised {said}); run it where that is "
                              "available, or point --impl at a factory that builds it for one process")


def _needs_setup(raised: list[str]) -> tuple[str, str]:
    """(``a distributed/model-parallel setup`` or ``CUDA``, the error that says so) when a try raised so, else
    ``("", "")``: an assignment that reached a ``.cuda()`` got past the arguments the others stopped at."""
    for text in raised:
        lowered = text.lower()
        if any(w in lowered for w in DISTRIBUTED_WORDS):
            return "a distributed/model-parallel setup that is not initialised in this process", text
        if any(w in lowered for w in CUDA_WORDS) and not torch.cuda.is_available():
            return "CUDA, which this machine does not have", text
    return "", ""


def _refuse_block(target) -> None:
    """Refuse a class that built under some role assignment but is a whole transformer block (plugins.stages)."""
    from attnbench.plugins.roles import BUILT, whole_block

    module, spec = BUILT.pop(target, (None, None))
    block = whole_block(module, spec) if module is not None else None
    if block is not None:
        raise PluginLoadError(f"{getattr(target, '__qualname__', target)} is a whole block, not an attention layer: "
                              f"{block}; check the attention class itself (FILE:Class)")


def _builds(binding: Binding) -> bool:
    """Does ``binding`` build its class at the probes' sizes (:data:`~attnbench.plugins.roles.PROBES`)?"""
    from attnbench.plugins.roles import PROBES

    try:
        for spec in PROBES:
            binding(replace(spec, num_kv_heads=None))
    except Exception:
        return False
    return True


def _by_roles(target, unknown, known, extras, modules) -> Binding | None:
    """A keywords binding with roles for the ``unknown`` parameters decided by probes (:mod:`attnbench.plugins.roles`),
    or None when no assignment fits."""
    from attnbench.plugins.roles import BUILT, solve, unhinted_dropouts

    def build_with(params):
        return Binding(target, "keywords", params=(*known, *params), extras=extras, modules=modules)

    solved, errors = solve(build_with, target, list(unknown), {f for _, f in known})
    if solved is None:
        _refuse_block(target)
        TRIED[target] = errors
        return None
    BUILT.pop(target, None)  # kept only to tell a whole block from a class no role fits
    params, held, note = unhinted_dropouts(build_with, solved.params, list(unknown), target)
    return Binding(target, "keywords", params=(*known, *params), extras=(*extras, *held), modules=modules,
                   notes=(solved.note, *([note] if note else [])), one_width=solved.one_width)


PROJECTION_WORDS = {"q": "d_in, d_out, bias=qkv_bias", "kv": "d_in, num_kv_heads * head_dim, bias=qkv_bias",
                    "out": "d_out, d_out"}


def projections(modules: tuple[tuple[str, str], ...], values: dict) -> dict[str, nn.Module]:
    """The projection modules a constructor takes (:data:`PROJECTIONS`), built for the spec's ``values``."""
    sizes = {"q": (values["d_in"], values["d_out"], values["qkv_bias"]),
             "kv": (values["d_in"], values["num_kv_heads"] * values["head_dim"], values["qkv_bias"]),
             "out": (values["d_out"], values["d_out"], True)}
    return {param: nn.Linear(*sizes[role][:2], bias=bool(sizes[role][2])) for param, role in modules}


VARIANT_WORDS = ("sliding", "local", "window", "chunk", "cross", "linear", "sparse", "swa")
"""Words that name a variant in a choice (``AttentionType.LOCAL_SLIDING``): the plain member is another."""


class Placement(enum.Enum):
    """A required ``device`` or ``dtype`` parameter (shap-e's ``MultiheadAttention(*, device, dtype, ...)``): it gets
    where and in what the case builds, resolved when the class is built (``cpu``, the default dtype)."""

    DEVICE = "device"
    DTYPE = "dtype"

    def resolve(self):
        return torch.device("cpu") if self is Placement.DEVICE else torch.get_default_dtype()

    def __repr__(self) -> str:
        return f"<the case's {self.value}>"


PLACEMENT = {"device": Placement.DEVICE, "dtype": Placement.DTYPE}


def _placement(p: inspect.Parameter) -> str:
    """``device`` or ``dtype`` for a parameter that names or is annotated as one, else ``""``."""
    ann = p.annotation
    kinds = {torch.device: "device", torch.dtype: "dtype", "torch.device": "device", "torch.dtype": "dtype"}
    if isinstance(ann, (type, str)) and ann in kinds:
        return kinds[ann]
    return p.name if p.name in PLACEMENT and ann is p.empty else ""


def fixed(extras) -> dict:
    """``extras`` as keyword arguments, each :class:`Placement` resolved to the build's device or dtype."""
    return {k: v.resolve() if isinstance(v, Placement) else v for k, v in extras}


def choice_extras(target, params: list[inspect.Parameter]) -> tuple[tuple[str, object], ...]:
    """Required parameters annotated with an :class:`enum.Enum` or a ``Literal`` (``Attention(config, attn_type:
    AttentionType)``): each gets its first plain member, the first whose name says no variant (:data:`VARIANT_WORDS`),
    else the first."""
    if not params:
        return ()
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # an annotation that does not resolve here: no choice is made from it
        return ()
    out = []
    for p in params:
        hint = hints.get(p.name)
        if inspect.isclass(hint) and issubclass(hint, enum.Enum):
            members = list(hint)
        elif typing.get_origin(hint) is typing.Literal:
            members = list(typing.get_args(hint))
        else:
            continue
        plain = [m for m in members if not any(w in str(getattr(m, "name", m)).lower() for w in VARIANT_WORDS)]
        if members:
            out.append((p.name, (plain or members)[0]))
    return tuple(out)


def capabilities(obj) -> dict:
    """The validated ``attnbench_capabilities`` of ``obj`` (a dict of :class:`~attnbench.registry.Implementation` fields)."""
    caps = dict(getattr(obj, "attnbench_capabilities", {}) or {})
    unknown = sorted(set(caps) - set(_CAPABILITY_KEYS))
    if unknown:
        raise PluginLoadError(f"{getattr(obj, '__qualname__', obj)}.attnbench_capabilities has unknown key(s) "
                              f"{unknown}; the keys are {', '.join(_CAPABILITY_KEYS)} (docs/own-attention.md: Capabilities)")
    return caps
