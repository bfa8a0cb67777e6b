"""A KV-cache *object* its caller creates, passes in on every step and advances (nanochat), as a protocol.

Some forwards take their cache as an object with an API of its own and return only the output:
``forward(x, ..., kv_cache)`` with ``kv_cache=None`` meaning "no cache" (a prefill over the whole sequence), and
while decoding an object the model made once and advances after each step. attnbench is that model. It
recognises the common shape, flash-attention's ``flash_attn_with_kvcache`` cache (nanochat's ``KVCache``): a
forward that reads ``get_layer_cache`` from the object gets a :class:`FlashCache`, whose
``get_layer_cache(layer_idx)`` returns preallocated ``(B, T_max, H_kv, D)`` key and value buffers the forward
writes in place at ``cache_seqlens`` (a ``(B,)`` int32 tensor), with ``n_layers = 1`` and ``advance(n)``. After a
step attnbench advances it by the step's tokens unless the forward did (nanochat advances it in its last layer). A
forward that calls ``update`` on it first gets Hugging Face's shape, a :class:`LayerCache` (``update(k, v, layer_idx)``
appends and returns every key and value so far, as ``DynamicCache`` does).

**Protocol** for any other cache object: give the class an ``attnbench_cache_object`` attribute, a
:class:`CacheObject`::

    class MyAttention(nn.Module):
        attnbench_cache_object = attnbench.CacheObject(
            make=lambda spec, batch, device, dtype: MyCache(batch, spec.context_length, spec.kv_heads,
                                                            spec.head_dim, device=device, dtype=dtype),
            advance=lambda cache, n: cache.advance(n),   # what the model does after each step (None: nothing)
            position=lambda cache: cache.pos)             # optional: advance only when the forward did not

The forward gets ``None`` outside decoding and the object (made at the first decoding step, kept until
``reset_cache()``) while decoding. The decode timer puts the object's state back after each timed step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnbench.plugins.module_cache import AppendingCache


@dataclass(frozen=True)
class CacheObject:
    """How attnbench makes and advances a class's cache object (see the module docstring)."""

    make: Callable[..., object]  # (spec, batch, device, dtype) -> the empty cache object
    advance: Callable[[object, int], None] | None = None  # (cache, n_tokens): after each step
    position: Callable[[object], int] | None = None  # (cache) -> tokens held: advance only if the step did not
    words: str = "its attnbench_cache_object"

    def step(self, cache, run: Callable[[], object], n_tokens: int):
        """``run()`` one step with ``cache``, then advance it as the model would; returns what ``run`` returned."""
        before = self.position(cache) if self.position is not None else None
        out = run()
        if self.advance is not None and (before is None or self.position(cache) == before):
            self.advance(cache, n_tokens)
        return out


class FlashCache:
    """flash-attention's KV cache for ``flash_attn_with_kvcache``, for one layer: keys and values ``(n_layers, B,
    T_max, H_kv, D)`` written in place at ``cache_seqlens``."""

    attnbench_state = True  # plugins.cache_state snapshots and restores it

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, device=None, dtype=None,
                 n_layers: int = 1) -> None:
        shape = (n_layers, batch, max_len, kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.n_layers, self.batch_size, self.max_seq_len = n_layers, batch, max_len
        self.n_heads, self.head_dim = kv_heads, head_dim

    def get_layer_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def advance(self, num_tokens: int) -> None:
        self.cache_seqlens += num_tokens

    def get_pos(self) -> int:
        return int(self.cache_seqlens[0])

    def reset(self) -> None:
        self.cache_seqlens.zero_()


FLASH = CacheObject(
    make=lambda spec, batch, device, dtype: FlashCache(batch, spec.context_length, spec.kv_heads, spec.head_dim,
                                                       device, dtype),
    advance=FlashCache.advance, position=FlashCache.get_pos,
    words="a FlashCache (flash_attn_with_kvcache style: get_layer_cache, cache_seqlens, n_layers=1, advance)")
class LayerCache:
    """Hugging Face's cache-object convention (``DynamicCache``), for the layers attnbench builds: ``update(key_states,
    value_states, layer_idx, cache_kwargs=None)`` (or ``update(layer_idx, k, v)``) appends the step's keys and values
    ``(B, H_kv, S_new, D)`` for that
    layer and returns all of them; ``get_seq_length(layer_idx=0)`` the tokens held."""

    attnbench_state = True  # plugins.cache_state snapshots and restores it

    def __init__(self) -> None:
        self.layers: dict[int, AppendingCache] = {}  # each layer's keys and values, appended as a module cache's
        self.tokens: int | None = None  # the step's new tokens, set by attnbench before each step (the sequence axis)

    def update(self, key_states, value_states, layer_idx=0, *args, **kwargs):
        """``cache_kwargs`` (positionally or as ``kwargs=``, as transformers 5 passes them) are not needed here. The
        layer index may come first (``update(layer_idx, k, v)``, from-scratch caches): it is the argument that is an
        int; an int equal to the tokens layer 0 holds is a write position (``update(start_pos, k, v)``), which
        appending honours; so is one in the layer index's place (``update(k, v, start_pos)``, with ``(B, S_new, H, D)``
        keys appended along their sequence axis)."""
        if isinstance(key_states, int) and isinstance(layer_idx, torch.Tensor):
            first, key_states, value_states = key_states, value_states, layer_idx
            layer_idx = first
        if isinstance(layer_idx, int) and layer_idx not in self.layers and 0 in self.layers \
                and layer_idx in self.layers[0].lengths():  # a write position (``update(k, v, start_pos)``)
            layer_idx = 0
        return self.layers.setdefault(layer_idx, AppendingCache()).update(None, key_states, value_states, self.tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.layers.get(layer_idx)
        return 0 if layer is None or layer.k is None else int(layer.k.shape[-2 if layer.axis is None else layer.axis])


LAYER = CacheObject(make=lambda spec, batch, device, dtype: LayerCache(),
                    words="a LayerCache (Hugging Face DynamicCache style: update(k, v, layer_idx) appends and returns "
                          "all keys and values)")
SHAPES = {"get_layer_cache": "flash", "update": "layer"}
"""The first attribute a forward reads from its cache object -> the shape attnbench recognises."""


def cache_object_for(target, kind: str | None) -> CacheObject | None:
    """The :class:`CacheObject` of a plan's ``cache_object`` kind: ``declared`` (the class's own), ``flash``,
    ``layer``."""
    if kind == "declared":
        return target.attnbench_cache_object
    return {"flash": FLASH, "layer": LAYER}.get(kind)


class _Recorder:
    """Passed as a cache object on a probe: records the attributes the forward reads (and has none)."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self.read.append(name)
        raise AttributeError(f"attnbench probe: {name}")


def recognise(run_with: Callable[[object], object], target) -> str | None:
    """The kind of cache object ``target``'s forward takes: ``declared`` when the class has an
    ``attnbench_cache_object``, else the shape :data:`SHAPES` names for the first attribute the forward reads from
    the object ``run_with(obj)`` passes it; ``None`` when neither."""
    if isinstance(getattr(target, "attnbench_cache_object", None), CacheObject):
        return "declared"
    recorder = _Recorder()
    try:
        run_with(recorder)
    except Exception:  # expected: the recorder has no attributes
        pass
    return next((SHAPES[n] for n in recorder.read if n in SHAPES), None)
