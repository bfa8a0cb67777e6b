"""A KV cache the class keeps as a module attribute that its caller installs: ``self.kv_cache`` (gpt-fast, litgpt).

Such a class is built with ``self.kv_cache = None`` (no cache: a prefill over the whole sequence) and its model
installs a cache object before decoding (gpt-fast: ``attn.kv_cache = KVCache(...)``, whose
``update(input_pos, k, v)`` writes the step's keys and values in place and returns the cache so far). attnbench
is that model: while decoding it installs a :class:`AppendingCache`, whose ``update`` (also callable as
``cache(input_pos, k, v)``, as litgpt calls its cache) appends the step's keys and values along the sequence
dimension (``(B, H, S, D)``, the layout both use) and returns all of them, so the step's mask is
``(T_new, T_total)`` as for every other class. Outside decoding the attribute is ``None``, as the class was built.

A class that builds its own cache (litgpt: ``attn.build_kv_cache(batch_size, max_seq_length, device=, dtype=)``,
whose forward refuses any object that is not its ``KVCache``) gets that cache instead: :func:`cache_builder` names the
method, :func:`build_own_cache` calls it for the step's batch, the spec's context length, device and dtype. Such a
cache is preallocated and written at positions: while decoding, attnbench gives the class its positions as a tensor
``(T_new,)`` and, where the forward takes it (litgpt's ``input_pos_maxp1``), the end of the filled part, so that the
keys it attends over are those the mask covers.

The protocol, for a class that keeps its cache elsewhere: give it an ``attnbench_cache_attr = "name"`` class
attribute naming the attribute its forward reads the cache object from, and have the forward call
``update(input_pos, k, v)`` (or call the object) on it and use the keys and values it returns.
"""

from __future__ import annotations

import inspect
import re

import torch

from attnbench.plugins import signatures

CACHE_ATTRS = ("kv_cache", "cache", "kv", "layer_cache", "past_key_value")
"""Attribute names a forward reads its installed cache object from (``self.kv_cache.update(...)``)."""


class AppendingCache:
    """What attnbench installs as a class's cache object while decoding: keys and values appended per step."""

    attnbench_state = True  # callable, yet state: plugins.cache_state snapshots and restores it

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.axis: int | None = None  # the sequence axis, once a second step shows it

    def update(self, input_pos, k_val: torch.Tensor, v_val: torch.Tensor,
               tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_val``/``v_val`` and return the keys and values so far: along the sequence axis, ``-2`` for
        ``(B, H, S_new, D)`` (Hugging Face's) or ``1`` for ``(B, S_new, H, D)`` (Meta's): the one of the two that holds
        the step's ``tokens`` when only one does, else the one where a step's size differs from what is held (``-2``
        when neither or both do)."""
        if self.axis is None and tokens is not None and k_val.dim() == 4:
            holds = [a for a in (1, -2) if k_val.shape[a] == tokens]
            self.axis = holds[0] if len(holds) == 1 else None
        if self.k is not None and self.axis is None:
            differ = [a for a in (1, -2) if self.k.dim() == 4 and self.k.shape[a] != k_val.shape[a]]
            self.axis = differ[0] if len(differ) == 1 else -2
        self.k = k_val if self.k is None else torch.cat([self.k, k_val], dim=self.axis)
        self.v = v_val if self.v is None else torch.cat([self.v, v_val], dim=self.axis)
        return self.k, self.v

    def lengths(self) -> set[int]:
        """The tokens it may hold: its sequence axis's size, or either candidate's before a second step shows it."""
        if self.k is None:
            return {0}
        return {self.k.shape[self.axis]} if self.axis is not None or self.k.dim() != 4 else \
            {self.k.shape[1], self.k.shape[-2]}

    __call__ = update
    forward = update


def cache_attr(target) -> str | None:
    """The attribute ``target.forward`` reads a caller-installed cache object from (``self.kv_cache.update(...)``,
    ``self.kv_cache(...)``), its ``attnbench_cache_attr`` when it declares one; ``None`` when it reads none."""
    declared = getattr(target, "attnbench_cache_attr", None)
    if isinstance(declared, str):
        return declared
    try:
        source = inspect.getsource(target.forward)
    except (TypeError, OSError, AttributeError):
        return None
    for name in CACHE_ATTRS:
        if re.search(rf"self\.{name}\s*(\.\s*(update|forward)\s*)?\(", source) and (  # called, and tested:
                re.search(rf"self\.{name}\s+is\s+(not\s+)?None", source)  # against None (gpt-fast)
                or re.search(rf"isinstance\(\s*self\.{name}\s*,", source)):  # against its class (litgpt)
            return name
    return None


BUILDER_NAMES = ("build_kv_cache", "init_kv_cache", "setup_kv_cache", "make_kv_cache")
"""Methods that build a class's own cache object (litgpt's ``build_kv_cache``)."""
BATCH_NAMES = ("batch_size", "max_batch_size", "batch", "bsz")
LENGTH_NAMES = ("max_seq_length", "max_seq_len", "max_length", "max_cache_len", "seq_len", "max_seq")


def cache_builder(target) -> str | None:
    """The method of ``target`` that builds its own cache object (:data:`BUILDER_NAMES`), when it can be called
    with a batch size and a length by name (anything else it takes has a default)."""
    for name in BUILDER_NAMES:
        method = getattr(target, name, None)
        if not callable(method):
            continue
        try:
            params = list(signatures.signature(method).parameters.values())[1:]  # self
        except (TypeError, ValueError):
            continue
        names = {p.name for p in params}
        required = {p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if names & set(BATCH_NAMES) and names & set(LENGTH_NAMES) and required <= set(BATCH_NAMES) | set(LENGTH_NAMES):
            return name
    return None


def build_own_cache(module, method: str, batch: int, length: int, device, dtype):
    """``module.<method>(...)`` for ``batch`` sequences of up to ``length`` tokens on ``device`` in ``dtype``, its
    parameters bound by name (those it has; the others keep their defaults)."""
    fn = getattr(module, method)
    names = set(signatures.signature(fn).parameters)
    kwargs = {n: batch for n in BATCH_NAMES if n in names}
    kwargs.update({n: length for n in LENGTH_NAMES if n in names})
    kwargs.update({k: v for k, v in (("device", device), ("dtype", dtype)) if k in names})
    return fn(**kwargs)


def describe_attr_cache(name: str, builder: str | None = None) -> str:
    """The ``check -v`` line for a plan with a module-attribute cache."""
    if builder:
        return (f"bound self.{name}: None outside decoding (as built); while decoding its own cache, "
                f"self.{builder}(batch, context_length, device, dtype), written at the step's positions (given as a "
                "tensor)")
    return (f"bound self.{name}: None outside decoding (as built); while decoding a cache object whose "
            "update(input_pos, k, v) appends the step's keys and values and returns them all")
