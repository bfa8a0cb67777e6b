"""A KV cache the class keeps as a module attribute that its caller installs: ``self.kv_cache`` (gpt-fast, litgpt).

Such a class is built with ``self.kv_cache = None`` (no cache: a prefill over the whole sequence) and its model
installs a cache object before decoding (gpt-fast: ``attn.kv_cache = KVCache(...)``, whose
``update(input_pos, k, v)`` writes the step's keys and values in place and returns the cache so far). attnbench
is that model: while decoding it installs a :class:`AppendingCache`, whose ``update`` (also callable as
``cache(input_pos, k, v)``, as litgpt calls its cache) appends the step's keys and values along the sequence
dimension (``(B, H, S, D)``, the layout both use) and returns all of them, so the step's mask is
``(T_new, T_total)`` as for every other class. Outside decoding the attribute is ``None``, as the class was built.

The protocol, for a class that keeps its cache elsewhere: give it an ``attnbench_cache_attr = "name"`` class
attribute naming the attribute its forward reads the cache object from, and have the forward call
``update(input_pos, k, v)`` (or call the object) on it and use the keys and values it returns.
"""

from __future__ import annotations

import inspect
import re

import torch

CACHE_ATTRS = ("kv_cache", "cache", "kv", "layer_cache", "past_key_value")
"""Attribute names a forward reads its installed cache object from (``self.kv_cache.update(...)``)."""


class AppendingCache:
    """What attnbench installs as a class's cache object while decoding: keys and values appended per step."""

    attnbench_state = True  # callable, yet state: plugins.cache_state snapshots and restores it

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, input_pos, k_val: torch.Tensor, v_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_val``/``v_val`` (``(B, H, S_new, D)``) and return the keys and values so far."""
        self.k = k_val if self.k is None else torch.cat([self.k, k_val], dim=-2)
        self.v = v_val if self.v is None else torch.cat([self.v, v_val], dim=-2)
        return self.k, self.v

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
        if re.search(rf"self\.{name}\s*(\.\s*(update|forward)\s*)?\(", source) and \
                re.search(rf"self\.{name}\s+is\s+(not\s+)?None", source):
            return name
    return None


def describe_attr_cache(name: str) -> str:
    """The ``check -v`` line for a plan with a module-attribute cache."""
    return (f"bound self.{name}: None outside decoding (as built); while decoding a cache object whose "
            "update(input_pos, k, v) appends the step's keys and values and returns them all")
