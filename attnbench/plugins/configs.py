"""A config parameter filled with the class's *own* config type, when its file defines one.

``Attention(config: ModelArgs)`` (gpt-fast), ``CausalSelfAttention(config, layer_idx)`` next to a ``GPTConfig``
dataclass (nanochat) or ``CausalSelfAttention(config: Config, block_idx)`` (litgpt) read their config with the
class's own field names, defaults and ``__post_init__``. attnbench builds that type: every field whose name says
which spec field it is (:data:`~attnbench.plugins.aliases.ALIASES`: ``n_local_heads``, ``n_query_groups``,
``n_kv_head`` are key/value heads; ``dim``, ``n_embd`` the width; ...) gets the spec's value, and the rest keep
the class's defaults. ``check -v`` prints the mapping and the defaults kept.

The type is the constructor's annotation when it is a class; else the one dataclass of the class's module whose
name ends in ``Config``/``Args``/``Params`` (two or more such, and none annotated: attnbench's
:class:`~attnbench.plugins.binding.SpecConfig`, which carries every alias, is passed instead).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

from attnbench.plugins import signatures
from attnbench.plugins.aliases import BY_NAME as _BY_NAME
from attnbench.plugins.aliases import spec_values
from attnbench.plugins.binding import Binding, hf_rope_scaling
from attnbench.spec import AttnSpec

_CONFIG_SUFFIXES = ("Config", "Args", "Params", "Hparams", "Configuration")


def own_config_type(target, param: str) -> type | None:
    """The config type ``target``'s ``param`` takes: its annotation, or the one config dataclass of its module."""
    try:
        annotation = signatures.signature(target).parameters[param].annotation
    except (TypeError, ValueError, KeyError):
        return None
    module = sys.modules.get(getattr(target, "__module__", ""), None)
    if isinstance(annotation, str) and module is not None:  # from __future__ import annotations
        annotation = getattr(module, annotation.strip("'\""), None)
    if inspect.isclass(annotation) and dataclasses.is_dataclass(annotation):
        return annotation
    if module is None:
        return None
    candidates = [v for v in vars(module).values() if inspect.isclass(v) and dataclasses.is_dataclass(v)
                  and v.__name__.endswith(_CONFIG_SUFFIXES)]
    return candidates[0] if len(candidates) == 1 else None


def _field_value(name: str, spec: AttnSpec, values: dict):
    if name == "rope_scaling":
        return hf_rope_scaling(spec)
    field = _BY_NAME.get(name)
    if field is None:
        return None
    return values["d_in"] if field == "d_in" else values[field]


@functools.lru_cache(maxsize=256)
def _tracking(cls: type, names: frozenset[str] | None = None) -> type:
    """A subclass of ``cls`` that records which of its fields (``names``, else its dataclass fields) are read (what a
    class reads is what it supports); one per class and names, not one per config built."""
    names = {f.name for f in dataclasses.fields(cls)} if names is None else names

    def __getattribute__(self, name):
        if name in names:
            read = object.__getattribute__(self, "__dict__").get("_attnbench_read")
            if read is not None and name not in read:
                read.append(name)
        return cls.__getattribute__(self, name)  # the class's own (a PreTrainedConfig maps aliases in it)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})


def config_factory(cls: type, skip: tuple[str, ...] = ()):
    """``spec -> cls(...)``: the fields that name a spec field get its value (a value the spec does not have,
    like ``rope_scaling=None``, keeps the class's default), the rest, and those of the spec fields in ``skip``,
    their defaults."""
    try:
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in signatures.signature(cls).parameters.values())
    except (TypeError, ValueError):
        takes_kwargs = False
    # a subclass of a config whose __init__ is its own (it reads **kwargs) may get a generated one instead (a
    # PreTrainedConfig subclass is re-made a dataclass): such a config is built as it is, and then tracked
    tracked = cls if takes_kwargs else _tracking(cls)

    def make(spec: AttnSpec):
        values = spec_values(spec)
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = _field_value(f.name, spec, values) if f.init and _BY_NAME.get(f.name) not in skip else None
            if value is not None:
                kwargs[f.name] = value
        kwargs.update(placeholders(cls, kwargs))
        if takes_kwargs:  # a config that reads its fields from **kwargs (a PreTrainedConfig subclass): every alias
            kwargs.update({a: v for a, v in aliases(spec).items() if a not in kwargs and v is not None})
        config = _built(tracked, kwargs, takes_kwargs)
        if takes_kwargs:  # built as it is, then tracked: its class swapped for one that records what is read
            try:
                config.__class__ = _tracking(cls, frozenset(k for k in vars(config) if not k.startswith("_")))
            except TypeError:  # a layout that cannot take a subclass: reads untracked
                pass
        config.__dict__["_attnbench_read"] = None
        return config

    return make


def _built(cls: type, kwargs: dict, takes_kwargs: bool):
    """``cls(**kwargs)``; a kwargs config that raises on the ``rope_scaling`` alias it was given among every alias
    (Hugging Face standardises it before a subclass has set ``max_position_embeddings``: minimind's config) is built
    without it: a class handed its tables scales nothing itself, and one that builds its own reads no scaling."""
    try:
        return cls(**kwargs)
    except Exception:
        if not takes_kwargs or kwargs.get("rope_scaling") is None:
            raise
        return cls(**{k: v for k, v in kwargs.items() if k != "rope_scaling"})


PLACEHOLDERS = {"int": 1, "float": 0.0, "bool": False}
"""What a required config field no spec field names gets, by its annotation (a whole model's ``vocab_size``,
``n_layer`` beside the attention's: happy-llm's ``ModelArgs``): ``check -v`` lists them."""


def placeholders(cls: type, given: dict) -> dict:
    """The required ``int``/``float``/``bool`` fields of ``cls`` that ``given`` lacks, with a placeholder (a ``str`` is a
    choice: left for the refusal to name)."""
    out = {}
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if not f.init or f.name in given or f.default is not dataclasses.MISSING \
                or f.default_factory is not dataclasses.MISSING:
            continue
        if kind in PLACEHOLDERS:
            out[f.name] = PLACEHOLDERS[kind]
        elif _optional(f.type):  # i6_models' required `rel_pos_clip: Optional[int]`: None is one of its values
            out[f.name] = None
    return out


def _optional(annotation) -> bool:
    """Whether an annotation admits ``None``: ``Optional[int]``, ``int | None`` (as a string, too)."""
    if isinstance(annotation, str):
        return annotation.replace(" ", "").startswith("Optional[") or annotation.replace(" ", "").endswith("|None")
    return type(None) in getattr(annotation, "__args__", ())


def aliases(spec: AttnSpec) -> dict:
    """Every alias of every spec field (:data:`~attnbench.plugins.aliases.ALIASES`) with the spec's value."""
    values = spec_values(spec)
    return {alias: _field_value(alias, spec, values) for alias in _BY_NAME}


def describe(cls: type, skip: tuple[str, ...] = ()) -> str:
    """``GPTConfig(n_head=num_heads, n_embd=d_in; defaults kept: vocab_size=32768, ...)``."""
    mapped, kept, filled = [], [], placeholders(cls, {})
    for f in dataclasses.fields(cls):
        field = f.name if f.name == "rope_scaling" else _BY_NAME.get(f.name)
        if field in skip:
            kept.append(f"{f.name}={f.default!r} (the mask forward takes carries the {field})")
        elif field is not None and f.init:
            mapped.append(f"{f.name}={field}")
        elif f.default is not dataclasses.MISSING:
            kept.append(f"{f.name}={f.default!r}")
        elif f.name in filled:
            kept.append(f"{f.name}={filled[f.name]!r} (required, no spec field: a placeholder)")
        else:
            kept.append(f.name)
    return f"{cls.__name__}({', '.join(mapped)}; class defaults kept: {', '.join(kept) or 'none'})"


def with_own_config(binding: Binding, skip: tuple[str, ...] = ()) -> Binding:
    """``binding`` with its config parameter filled by the class's own config type, when it has one; the spec fields
    in ``skip`` (``window`` when ``forward`` takes a mask, which carries it) keep the class's defaults."""
    if binding.style != "config" or binding.config_factory is not None:
        return binding
    cls = own_config_type(binding.target, binding.config_param)
    if cls is None:
        return binding
    return dataclasses.replace(binding, config_factory=config_factory(cls, skip), config_note=describe(cls, skip))
