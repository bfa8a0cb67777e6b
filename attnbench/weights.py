"""Canonical weights: one layout every implementation imports and exports.

The canonical layout is the book's: ``W_q`` of shape ``(d_out, d_in)`` and ``W_k, W_v`` of shape
``(num_kv_heads * head_dim, d_in)`` (``(d_out, d_in)`` for multi-head attention; ``nn.Linear``
orientation, ``y = x @ W.T + b``), optional q/k/v biases of matching rows, ``W_o`` of shape
``(d_out, d_out)`` and ``b_o``. Rows ``h*head_dim:(h+1)*head_dim`` belong to head ``h``; query head
``h`` reads kv head ``h // (num_heads // num_kv_heads)``. Loading the same canonical weights into every implementation is what
makes "the same function" testable and every timing comparison fair.

A weight layout is described by an :class:`Adapter`: a *differentiable* map from canonical weights
to the module's parameter names (``to_state``) and its inverse (``from_state``). Because ``to_state``
is differentiable, gradients with respect to the canonical parameters of any implementation can be
taken with :func:`torch.func.functional_call`, whatever its layout.

DeepSeek-style MLA (issue 46, ``spec.is_mla``) has canonical weights of its own shapes (:func:`mla_shapes`): ``W_dq``
and its latent norm's gain ``g_dq`` (with ``q_lora_rank``), ``W_q`` the query (up-)projection whose head ``h`` is rows
``h*qk_head_dim:(h+1)*qk_head_dim`` split ``[nope | rope]``, ``W_dkv`` the kv down-projection (DeepSeek's ``wkv_a``:
the first ``kv_lora_rank`` rows the latent, the last ``qk_rope_head_dim`` the shared rotary key ``k_pe``), ``g_dkv``
the kv latent norm's gain, ``W_k`` = W_UK (head ``h``'s ``qk_nope_head_dim`` rows), ``W_v`` = W_UV (head ``h``'s
``v_head_dim`` rows), and ``W_o`` ``(d_out, num_heads * v_head_dim)``. DeepSeek's ``wkv_b`` is ``[W_UK_h; W_UV_h]``
stacked per head.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.spec import AttnSpec

NAMES = ("W_q", "W_k", "W_v", "b_q", "b_k", "b_v", "W_o", "b_o")
GAIN_NAMES = ("g_q", "g_k")
"""The effective QK-norm gains (issue 26): present exactly when ``spec.qk_norm`` is set."""


@dataclass(frozen=True)
class CanonicalWeights:
    """The canonical parameters of one multi-head attention layer (biases ``None`` when absent)."""

    W_q: torch.Tensor  # (d_out, d_in)
    W_k: torch.Tensor  # (kv_dim, d_in), kv_dim = num_kv_heads * head_dim (= d_out for MHA)
    W_v: torch.Tensor  # (kv_dim, d_in)
    b_q: torch.Tensor | None  # (d_out,) or None
    b_k: torch.Tensor | None  # (kv_dim,) or None
    b_v: torch.Tensor | None
    W_o: torch.Tensor  # (d_out, d_out)
    b_o: torch.Tensor  # (d_out,)
    # The EFFECTIVE RMSNorm gains of QK-norm (what multiplies the normalised vector, e.g. Gemma's 1 + scale):
    # (head_dim,) each for qk_norm="head"; (d_out,) resp. (kv_dim,) for "full"; None without QK-norm.
    g_q: torch.Tensor | None = None
    g_k: torch.Tensor | None = None
    # Issue 37: the per-head attention-sink logits (num_heads,) when spec.sinks (attnbench.correctness.masks), else None.
    sinks: torch.Tensor | None = None
    # Issue 46, DeepSeek-style MLA only (mla_shapes): the query's down-projection and its latent norm's gain (with
    # q_lora_rank), the kv down-projection [latent | k_pe] and the kv latent norm's gain.
    W_dq: torch.Tensor | None = None  # (q_lora_rank, d_in)
    g_dq: torch.Tensor | None = None  # (q_lora_rank,)
    W_dkv: torch.Tensor | None = None  # (kv_lora_rank + qk_rope_head_dim, d_in)
    g_dkv: torch.Tensor | None = None  # (kv_lora_rank,)

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs of the parameters that exist, in canonical order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> CanonicalWeights:
        """A copy with ``fn`` applied to every present tensor."""
        return replace(self, **{name: fn(t) for name, t in self.items()})

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> CanonicalWeights:
        """A copy on ``device`` in ``dtype``."""
        return self.map(lambda t: t.detach().to(device=device, dtype=dtype))

    def leaves(self) -> CanonicalWeights:
        """A detached copy whose tensors require grad (for gradient checks)."""
        return self.map(lambda t: t.detach().clone().requires_grad_(True))

    def check(self, spec: AttnSpec) -> None:
        """Raise ``ValueError`` unless the shapes match ``spec``."""
        kv = spec.kv_dim
        want = {"W_q": (spec.d_out, spec.d_in), "W_k": (kv, spec.d_in), "W_v": (kv, spec.d_in),
                "b_q": (spec.d_out,), "b_k": (kv,), "b_v": (kv,),
                "W_o": (spec.d_out, spec.d_out), "b_o": (spec.d_out,), **gain_shapes(spec),
                "sinks": (spec.num_heads,)}
        if getattr(spec, "is_mla", False):
            want = {**mla_shapes(spec), "sinks": (spec.num_heads,)}
            lacking = [n for n in mla_shapes(spec) if getattr(self, n) is None]
            if lacking:
                raise ValueError(f"spec is DeepSeek MLA (kv_lora_rank={spec.kv_lora_rank}) but the weights lack "
                                 f"{', '.join(lacking)} (random_weights(spec) draws them)")
        for name, t in self.items():
            if tuple(t.shape) != want.get(name, ()):
                raise ValueError(f"canonical {name} has shape {tuple(t.shape)}, expected {want.get(name)}"
                                 + ("" if name in want else " (a weight this spec does not have)"))
        if (self.b_q is None) == spec.qkv_bias:
            raise ValueError(f"spec.qkv_bias={spec.qkv_bias} but the weights {'lack' if spec.qkv_bias else 'have'} q/k/v biases")
        if (self.g_q is None or self.g_k is None) == (spec.qk_norm is not None):
            raise ValueError(f"spec.qk_norm={spec.qk_norm!r} but the weights {'lack' if spec.qk_norm else 'have'} "
                             "QK-norm gains g_q/g_k")
        if (self.sinks is None) == bool(getattr(spec, "sinks", False)):
            raise ValueError(f"spec.sinks={getattr(spec, 'sinks', False)} but the weights "
                             f"{'lack' if self.sinks is None else 'have'} sink logits")


def gain_shapes(spec: AttnSpec) -> dict[str, tuple[int]]:
    """The shapes of ``g_q`` and ``g_k`` for ``spec.qk_norm`` (empty without QK-norm)."""
    if spec.qk_norm == "head":
        return {"g_q": (spec.head_dim,), "g_k": (spec.head_dim,)}
    if spec.qk_norm == "full":
        return {"g_q": (spec.d_out,), "g_k": (spec.kv_dim,)}
    return {}


def mla_shapes(spec: AttnSpec) -> dict[str, tuple[int, ...]]:
    """The canonical weights of DeepSeek-style MLA and their shapes (issue 46; see the module docstring)."""
    h, r = spec.num_heads, spec.kv_lora_rank
    shapes = {"W_q": (h * spec.qk_head_dim, spec.q_lora_rank or spec.d_in),
              "W_k": (h * spec.qk_nope_head_dim, r), "W_v": (h * spec.v_head_dim, r),
              "W_o": (spec.d_out, h * spec.v_head_dim), "b_o": (spec.d_out,),
              "W_dkv": (r + spec.qk_rope_head_dim, spec.d_in), "g_dkv": (r,)}
    if spec.q_lora_rank is not None:
        shapes.update(W_dq=(spec.q_lora_rank, spec.d_in), g_dq=(spec.q_lora_rank,))
    return shapes


_DRAWN: OrderedDict[tuple, CanonicalWeights] = OrderedDict()
"""Weights drawn by this process, most recently used last (:func:`random_weights` hands out copies)."""
DRAWN_CACHE_BYTES = 64 << 20
"""At most this many bytes of drawn weights are kept; larger weights are drawn anew every time."""


def fit_gains(w: CanonicalWeights, spec: AttnSpec, seed: int = 0) -> CanonicalWeights:
    """``w`` with QK-norm gains exactly when ``spec`` has QK-norm: gains of the right shape drawn from ``seed`` (in
    ``w``'s dtype and device) when it lacks them, dropped when ``spec`` has none. A class that always applies its
    QK-norm is built for a spec that says so (``PluginFactory.own_spec``), from weights drawn for one that did not."""
    shapes = gain_shapes(spec)
    if not shapes:
        return w if w.g_q is None and w.g_k is None else replace(w, g_q=None, g_k=None)
    if w.g_q is not None and tuple(w.g_q.shape) == shapes["g_q"] and tuple(w.g_k.shape) == shapes["g_k"]:
        return w
    drawn = random_weights(spec, seed=seed)
    return replace(w, g_q=drawn.g_q.to(device=w.W_q.device, dtype=w.W_q.dtype),
                   g_k=drawn.g_k.to(device=w.W_q.device, dtype=w.W_q.dtype))


def random_weights(spec: AttnSpec, seed: int = 0, dtype: torch.dtype = torch.float64,
                   scale: str = "unit") -> CanonicalWeights:
    """Canonical weights drawn from a seeded generator, independent of the global RNG.

    ``scale="unit"`` draws ``W_q, W_k, W_v ~ N(0, 1/d_in)`` so queries and keys have unit variance and
    the scaled scores are O(1): softmax is then far from uniform, so a wrong scale factor, a wrong
    mask or mixed heads changes the output by O(1), not by a rounding error.
    ``scale="linear"`` mimics ``nn.Linear``'s default init (for timing, where values do not matter).

    The same arguments always give the same values; each call returns tensors of its own (copies of the ones
    this process drew for those arguments before, kept up to :data:`DRAWN_CACHE_BYTES`: every member of a
    comparison group, in every round, is built from the same weights, and drawing them in float64 costs more
    than copying them).
    """
    if scale not in ("unit", "linear"):
        raise ValueError(f"scale must be 'unit' or 'linear', got {scale!r}")
    key = (spec, seed, dtype, scale)
    try:
        drawn = _DRAWN.get(key)
    except TypeError:  # a spec that cannot be hashed: nothing to look up
        return _draw(spec, seed, dtype, scale)
    if drawn is None:
        drawn = _draw(spec, seed, dtype, scale)
        _keep(key, drawn)
    else:
        _DRAWN.move_to_end(key)
    return drawn.map(torch.clone)


def _keep(key: tuple, w: CanonicalWeights) -> None:
    """Remember ``w`` for ``key``, forgetting the least recently used weights beyond :data:`DRAWN_CACHE_BYTES`."""
    def size(weights: CanonicalWeights) -> int:
        return sum(t.numel() * t.element_size() for _, t in weights.items())

    if size(w) > DRAWN_CACHE_BYTES:
        return
    _DRAWN[key] = w
    while sum(size(v) for v in _DRAWN.values()) > DRAWN_CACHE_BYTES:
        _DRAWN.popitem(last=False)


def _draw(spec: AttnSpec, seed: int, dtype: torch.dtype, scale: str) -> CanonicalWeights:
    """:func:`random_weights` drawn anew."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)

    if getattr(spec, "is_mla", False):
        return _draw_mla(spec, g, draw, scale)
    if scale == "unit":
        s_in, s_out, s_b = 1 / math.sqrt(spec.d_in), 1 / math.sqrt(spec.d_out), 0.5
    else:  # linear
        s_in, s_out = 1 / math.sqrt(3 * spec.d_in), 1 / math.sqrt(3 * spec.d_out)
        s_b = s_in

    def bias(rows: int) -> torch.Tensor | None:
        return draw(rows, std=s_b) if spec.qkv_bias else None

    kv = spec.kv_dim
    w = CanonicalWeights(
        W_q=draw(spec.d_out, spec.d_in, std=s_in), W_k=draw(kv, spec.d_in, std=s_in),
        W_v=draw(kv, spec.d_in, std=s_in), b_q=bias(spec.d_out), b_k=bias(kv), b_v=bias(kv),
        W_o=draw(spec.d_out, spec.d_out, std=s_out), b_o=draw(spec.d_out, std=s_b),
    )
    # QK-norm gains in [0.5, 1.5) drawn after the matrices (so the matrices are those of the spec without
    # QK-norm), never 1 and different for q and k: an order bug or a shared gain changes the output.
    gains = {n: (0.5 + torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype)
             for n, shape in gain_shapes(spec).items()}
    if getattr(spec, "sinks", False):  # issue 37: sink logits in [-1, 2), distinct per head (a head mix-up shows)
        gains["sinks"] = (3 * torch.rand(spec.num_heads, generator=g, dtype=torch.float64) - 1).to(dtype)
    return replace(w, **gains)


def _draw_mla(spec: AttnSpec, g: torch.Generator, draw: Callable[..., torch.Tensor], scale: str) -> CanonicalWeights:
    """DeepSeek MLA's canonical weights (:func:`mla_shapes`): each matrix ``N(0, 1/fan_in)`` (``unit``: unit-variance
    latents, queries and keys, so scores are O(1)) or ``nn.Linear``-like (``linear``); latent-norm gains in
    ``[0.5, 1.5)``, never 1 and different for q and kv (a skipped or swapped norm changes the output)."""
    def unit(name: str) -> torch.Tensor:
        rows, fan_in = shapes[name]
        return draw(rows, fan_in, std=(1 if scale == "unit" else 1 / math.sqrt(3)) / math.sqrt(fan_in))

    shapes = mla_shapes(spec)
    order = ["W_dq", "W_q", "W_dkv", "W_k", "W_v", "W_o"]  # drawn in this order, each from the one generator
    mats = {n: unit(n) for n in order if n in shapes}
    b_o = draw(spec.d_out, std=0.5 if scale == "unit" else 1 / math.sqrt(3 * shapes["W_o"][1]))
    gains = {n: (0.5 + torch.rand(shapes[n], generator=g, dtype=torch.float64)).to(b_o.dtype)
             for n in ("g_dq", "g_dkv") if n in shapes}
    sinks = None
    if getattr(spec, "sinks", False):
        sinks = (3 * torch.rand(spec.num_heads, generator=g, dtype=torch.float64) - 1).to(b_o.dtype)
    return CanonicalWeights(W_q=mats["W_q"], W_k=mats["W_k"], W_v=mats["W_v"], b_q=None, b_k=None, b_v=None,
                            W_o=mats["W_o"], b_o=b_o, sinks=sinks, W_dq=mats.get("W_dq"), g_dq=gains.get("g_dq"),
                            W_dkv=mats["W_dkv"], g_dkv=gains["g_dkv"])


@dataclass(frozen=True)
class Adapter:
    """How one weight layout maps to and from canonical weights.

    ``to_state(w, spec)`` must be differentiable in ``w`` (use slicing, ``cat``, ``reshape``, ``t()``)
    and return every trainable parameter of the module by its ``named_parameters()`` name.
    ``from_state(state, spec)`` is its inverse. ``held_at_zero`` names canonical parameters the layout
    does not have (a layer without an output bias): the correctness reference holds them at zero. ``held_at``
    names canonical parameters the layout holds at a constant instead, as ``(name, value)`` pairs (the gains of a
    QK-norm without weights followed by a constant factor: ``(("g_q", 1.2), ("g_k", 1.2))``).
    """

    to_state: Callable[[CanonicalWeights, AttnSpec], dict[str, torch.Tensor]]
    from_state: Callable[[Mapping[str, torch.Tensor], AttnSpec], CanonicalWeights]
    held_at_zero: frozenset[str] = frozenset()
    held_at: tuple[tuple[str, float | str], ...] = ()  # a value, or "eye": the identity

    @property
    def held(self) -> frozenset[str]:
        """Every canonical parameter the layout holds (at zero or at a constant): none has a gradient to compare."""
        return self.held_at_zero | {name for name, _ in self.held_at}


def _book_to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    state = {"W_query.weight": w.W_q, "W_key.weight": w.W_k, "W_value.weight": w.W_v,
             "out_proj.weight": w.W_o, "out_proj.bias": w.b_o}
    if spec.qkv_bias:
        state.update({"W_query.bias": w.b_q, "W_key.bias": w.b_k, "W_value.bias": w.b_v})
    if w.sinks is not None:  # issue 37: a module with attention sinks keeps them as its parameter ``sinks``
        state["sinks"] = w.sinks
    return state


def _book_from_state(s: Mapping[str, torch.Tensor], spec: AttnSpec) -> CanonicalWeights:
    return CanonicalWeights(
        W_q=s["W_query.weight"], W_k=s["W_key.weight"], W_v=s["W_value.weight"],
        b_q=s.get("W_query.bias"), b_k=s.get("W_key.bias"), b_v=s.get("W_value.bias"),
        W_o=s["out_proj.weight"], b_o=s["out_proj.bias"], sinks=s.get("sinks"),
    )


BOOK_ADAPTER = Adapter(_book_to_state, _book_from_state)
"""The layout of the book's ``MultiHeadAttention``: ``W_query``/``W_key``/``W_value``/``out_proj`` Linears."""


def _base(module: nn.Module) -> tuple[nn.Module, str]:
    """The module that owns the weights and the name prefix ``torch.compile`` adds."""
    orig = getattr(module, "_orig_mod", None)
    if isinstance(orig, nn.Module):
        return orig, "_orig_mod."
    return module, ""


def adapter_for(module: nn.Module) -> Adapter:
    """The :class:`Adapter` of ``module``: its own ``weight_adapter``, else the book's attribute names."""
    base, _ = _base(module)
    own = getattr(base, "weight_adapter", None)
    if isinstance(own, Adapter):
        return own
    if all(isinstance(getattr(base, n, None), nn.Linear) for n in ("W_query", "W_key", "W_value", "out_proj")):
        return BOOK_ADAPTER
    raise PluginLoadError(
        f"{type(base).__name__} has no canonical weight layout: name its projections W_query, W_key, "
        "W_value (nn.Linear(d_in, d_out)) and out_proj (nn.Linear(d_out, d_out)) as the book does, or give "
        "the class a `weight_adapter = attnbench.weights.Adapter(to_state, from_state)` attribute"
    )


def zero_held(module: nn.Module, w: CanonicalWeights) -> CanonicalWeights:
    """``w`` as ``module`` computes with it: the canonical parameters its layout lacks set to zero (or to the constant
    it holds them at, :attr:`Adapter.held_at`)."""
    adapter = adapter_for(module)
    fixed = dict(adapter.held_at)
    return replace(w, **{n: torch.zeros_like(t) if n in adapter.held_at_zero else
                         torch.eye(*t.shape, dtype=t.dtype, device=t.device) if fixed[n] == "eye" else  # no W_o at all
                         torch.full_like(t, fixed[n]) for n, t in w.items() if n in adapter.held_at_zero or n in fixed})


def state_from_canonical(module: nn.Module, w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    """The module's parameters as a differentiable function of ``w`` (names as ``named_parameters`` gives them)."""
    _, prefix = _base(module)
    return {prefix + k: v for k, v in adapter_for(module).to_state(w, spec).items()}


@torch.no_grad()
def load_weights(module: nn.Module, w: CanonicalWeights, spec: AttnSpec) -> nn.Module:
    """Copy canonical weights into ``module`` (in its own dtype and device); returns ``module``."""
    w.check(spec)
    state = state_from_canonical(module, w, spec)
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    trainable_missing = [n for n in missing if params[n].requires_grad]
    if trainable_missing or extra:
        raise PluginLoadError(
            f"{type(_base(module)[0]).__name__}'s weight adapter does not match its parameters: "
            f"not set by the adapter {trainable_missing}, unknown to the module {extra}"
        )
    for name, value in state.items():
        p = params[name]
        if tuple(p.shape) != tuple(value.shape):
            raise PluginLoadError(f"adapter gives {name} shape {tuple(value.shape)}, the module has {tuple(p.shape)}")
        p.copy_(value.to(dtype=p.dtype, device=p.device))
    return module


def export_weights(module: nn.Module, spec: AttnSpec) -> CanonicalWeights:
    """Read ``module``'s parameters back as canonical weights (detached copies)."""
    _, prefix = _base(module)
    state = {k[len(prefix):]: v.detach().clone() for k, v in module.named_parameters() if k.startswith(prefix)}
    return adapter_for(module).from_state(state, spec)
