"""Finding the canonical weights in a user's module, so that most classes need no adapter.

A plug-in is built once on a *probe* spec whose sizes all differ (d_in 20, d_out 24, 3*d_out 72, 4
heads of 6), and its trainable parameters are matched to the canonical ``W_q, W_k, W_v, W_o`` (and
biases) by name and shape:

* separate projections (``W_query``, ``query``, ``q_proj``, ``wq``, ``q``, ...), as ``nn.Linear`` or raw
  ``nn.Parameter``; fused ones (``qkv``, ``c_attn``, ``in_proj``, ``Wqkv``, ``qkv_proj``; ``kv``) in
  [q, k, v] order; per-head lists (``heads.{i}.query``); output projections (``out_proj``, ``proj``,
  ``c_proj``, ``o_proj``, ``wo``, ``dense``); ``nn.MultiheadAttention`` submodules; missing biases.
* Orientation (stored (out, in) as ``nn.Linear`` does, or (in, out) for ``x @ W``) is read from the
  parameter's shape on the probe, never by trying both against the reference (that would hide an
  untransposed-weight bug). A square matrix is an ``nn.Linear``'s (out, in), an HF ``Conv1D``'s
  (in, out), or a raw parameter that follows the class's q/k/v projections.

The result is a :class:`Layout`, which gives an :class:`~attnbench.weights.Adapter` (differentiable
``to_state`` and its inverse), so every gradient check of the matrix works through it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch
from torch import nn

from attnbench.errors import PluginLoadError, UnavailableError
from attnbench.plugins import by_shape, forms, fused_order, head_shaped, heads
from attnbench.plugins.binding import PROBE, SQUARE_PROBE
from attnbench.plugins.context import bind_context
from attnbench.plugins.mla import LowRank, find_low_rank, latent_dim
from attnbench.plugins.qk_norm import Gain, NormError, find_gains
from attnbench.spec import AttnSpec
from attnbench.weights import NAMES, Adapter, CanonicalWeights, gain_shapes, random_weights

GQA_PROBE_KV_HEADS = 2
"""The probes' kv heads for a grouped-query spec: keys and values of width 12, unlike every other size."""
DISPLAY = AttnSpec(d_in=768, d_out=768, context_length=1024, dropout=0.0, num_heads=12)
"""The sizes ``attnbench check -v`` prints the mapping for (GPT-2 small)."""
GUIDE = "docs/own-attention.md"

_CORES = {
    "q": ("q", "query", "queries", "qry"), "k": ("k", "key", "keys"), "v": ("v", "value", "values", "val"),
    "qkv": ("qkv", "cattn", "inproj", "qkvproj"), "kv": ("kv",),
    "o": ("o", "out", "output", "proj", "cproj", "dense", "projection"),
}
_ROLE_OF_CORE = {core: role for role, cores in _CORES.items() for core in cores}
_PREFIXES = ("", "w", "c", "to", "b", "bias", "linear", "lin", "proj", "layer", "fc", "weight", "attn", "attention", "self",
             "mat")
_SUFFIXES = ("", "proj", "projection", "linear", "lin", "layer", "weight", "weights", "w", "bias", "b", "mat",
             "matrix", "fc", "dense", "net", "param", "transform", "affine", "map")
_CANONICAL = {"q": ("W_q",), "k": ("W_k",), "v": ("W_v",), "qkv": ("W_q", "W_k", "W_v"), "kv": ("W_k", "W_v"),
              "o": ("W_o",)}


def role_of(token: str) -> str | None:
    """``"q_proj"`` -> ``"q"``, ``"c_attn"`` -> ``"qkv"``, ``"to_out"`` -> ``"o"``; ``None`` when the name says nothing."""
    s = re.sub(r"[^a-z0-9]", "", token.lower())
    for pre in _PREFIXES:
        if not s.startswith(pre):
            continue
        role = _role_of_core(s[len(pre):])
        if role is not None:
            return role
    return None


def _role_of_core(rest: str, suffixes: int = 2) -> str | None:
    """The role of ``rest`` with up to ``suffixes`` of :data:`_SUFFIXES` taken off its end (``outprojweight``: a bare
    parameter named like a projection's weight, GPT-SoVITS's ``out_proj_weight``)."""
    if rest in _ROLE_OF_CORE:
        return _ROLE_OF_CORE[rest]
    for suf in _SUFFIXES[1:] if suffixes else ():
        if rest.endswith(suf) and len(rest) > len(suf):
            role = _role_of_core(rest[:-len(suf)], suffixes - 1)
            if role is not None:
                return role
    return None


@functools.lru_cache(maxsize=64)
def canonical_shapes(spec: AttnSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every canonical parameter (biases included) for ``spec``."""
    w = random_weights(replace(spec, qkv_bias=True), scale="linear")
    return {name: tuple(t.shape) for name, t in w.items()}


@dataclass(frozen=True)
class Source:
    """One module parameter as a function of the canonical weights.

    ``canonical`` are concatenated along the output axis (a fused projection); ``per_head``: ``param``
    is a template (``heads.{i}.query.weight``) and head i holds the i-th of ``num_heads`` row blocks;
    ``transposed`` when stored (in, out).
    ``constant`` (``"zero"``/``"eye"``, with a symbolic ``shape``) is a parameter with no canonical
    counterpart, held fixed (``note`` says why).
    """

    param: str
    canonical: tuple[str, ...] = ()
    per_head: bool = False
    transposed: bool = False
    constant: str | None = None
    shape: tuple[str | int, ...] = ()
    note: str = ""
    heads_axis: str = ""  # stored with a heads axis of its own (plugins.head_shaped: TransformerLens's W_Q, b_Q)


@dataclass(frozen=True)
class Layout:
    """Where every canonical parameter lives in a module, and which ones it lacks."""

    sources: tuple[Source, ...]
    held_at_zero: frozenset[str] = frozenset()
    missing: tuple[str, ...] = ()  # biases the spec asks for that the module does not have (a bug the matrix shows)
    same_width_reason: str = ""  # why the module needs d_in == d_out (found only once built)
    gains: tuple[Gain, ...] = ()  # q/k norms holding the canonical g_q/g_k (plugins.qk_norm)
    low_rank: LowRank | None = None  # MLA: keys and values through a latent (plugins.mla)
    sinks: str = ""  # issue 37: the (num_heads,) parameter holding the canonical attention-sink logits
    fixed_gain: float | None = None  # a QK-norm without weights, then a constant factor (plugins.measured)
    kv_groups: str = ""  # "strided": query head h reads kv head h % kv_heads (plugins.heads, measured)
    eye_out: bool = False  # no output projection at all (x-transformers with one head): W_o held at I
    by_shape: tuple[str, ...] = ()  # issue 46: what names did not bind and shape did (plugins.by_shape)
    qkv_slots: tuple[str, ...] = ()  # three (or four) unnamed q/k/v(/o) weights, in registration order
    qkv_order: str = ""  # the roles plugins.by_shape.qkv_roles measured for them, in words (check -v)
    fused_rows: str = ""  # "per kv head": fused q/k/v rows in GPT-NeoX's order (plugins.fused_order, measured)

    @property
    def composed(self) -> bool:
        """True when the reference must take its weights from the module (a low-rank K/V path)."""
        return self.low_rank is not None
    square_only_problem: str = ""  # why its parameters do not fit when d_in != d_out (a bug the matrix shows)

    def to_state(self, w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
        """The module's parameters as a differentiable function of ``w``."""
        w = heads.reorder(w, spec, self.kv_groups)
        like = w.W_q
        state = {}
        for s in self.sources:
            if s.constant == "kept":  # left as built (plugins.by_shape.kept_scalars)
                continue
            if s.constant:
                dims = [spec.d_in if d == "d_in" else spec.d_out if d == "d_out" else int(d) for d in s.shape]
                t = torch.eye(dims[0], dtype=like.dtype, device=like.device) if s.constant == "eye" else \
                    torch.zeros(dims, dtype=like.dtype, device=like.device)
            elif s.per_head:
                for i, block in enumerate(_part(w, s.canonical[0]).chunk(heads_of(s.canonical[0], spec))):
                    state[s.param.format(i=i)] = block.t() if s.transposed else block
                continue
            else:
                t = torch.cat([_part(w, name) for name in s.canonical]) if len(s.canonical) > 1 else _part(w, s.canonical[0])
                t = fused_order.to_class(t, spec) if self._per_kv_head(s) else t
                t = t.t() if s.transposed else t
                t = head_shaped.to_class(t, heads_of(s.canonical[0], spec), s.heads_axis) if s.heads_axis else t
            state[s.param] = t
        for g in self.gains:
            gain = getattr(w, g.canonical, None)
            if gain is None:
                raise UnavailableError(f"{g.param} is a QK-norm gain ({g.placement}) but the spec has no qk_norm: "
                                       f"the class always normalises queries and keys")
            state[g.param] = g.to_param(gain)
        if self.low_rank is not None:
            state.update(self.low_rank.to_state(w, spec, latent_dim(spec)))
        if self.sinks and w.sinks is not None:
            state[self.sinks] = w.sinks
        return state

    def from_state(self, state, spec: AttnSpec) -> CanonicalWeights:
        """The canonical weights a module's parameters hold (the inverse of :meth:`to_state`)."""
        shapes = canonical_shapes(spec)
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        for s in self.sources:
            if s.constant:
                continue
            n = heads_of(s.canonical[0], spec) if s.per_head else 1
            stored = [state[s.param.format(i=i)] for i in range(n)] if s.per_head else [state[s.param]]
            stored = [head_shaped.to_reference(m, s.heads_axis) for m in stored] if s.heads_axis else stored
            t = torch.cat([m.t() if s.transposed else m for m in stored])
            t = fused_order.to_reference(t, spec) if self._per_kv_head(s) else t
            parts = t.split([shapes[n][0] for n in s.canonical]) if len(s.canonical) > 1 else (t,)
            for name, part in zip(s.canonical, parts, strict=True):
                pieces[name].append(part)
        values = {}
        for name in NAMES:
            if pieces.get(name):
                values[name] = torch.cat(pieces[name])
            elif name == "b_o" or (name.startswith("b_") and spec.qkv_bias):
                values[name] = torch.zeros(shapes[name], dtype=next(iter(state.values())).dtype)
        if not spec.qkv_bias:
            values.update(b_q=None, b_k=None, b_v=None)
        gains = {g.canonical: g.to_gain(state[g.param]) for g in self.gains if getattr(spec, "qk_norm", None)}
        if self.fixed_gain is not None and getattr(spec, "qk_norm", None):
            like = next(iter(state.values()))
            gains = {n: torch.full(shape, self.fixed_gain, dtype=like.dtype) for n, shape in gain_shapes(spec).items()}
        if self.low_rank is not None:
            composed = self.low_rank.compose(state)
            values.update(composed if spec.qkv_bias else {k: v for k, v in composed.items() if k.startswith("W")})
        if self.sinks and self.sinks in state:
            gains["sinks"] = state[self.sinks]
        if self.eye_out:
            values["W_o"] = torch.eye(spec.d_out, dtype=next(iter(state.values())).dtype)
        w = CanonicalWeights(**{n: values.get(n) for n in NAMES}, **gains)
        return heads.reorder(w, spec, self.kv_groups, inverse=True)

    def _per_kv_head(self, s: Source) -> bool:
        return bool(self.fused_rows) and s.canonical in fused_order.FUSED

    def adapter(self) -> Adapter:
        """This layout as an :class:`~attnbench.weights.Adapter` (with ``held_at_zero``)."""
        fixed = () if self.fixed_gain is None else (("g_q", self.fixed_gain), ("g_k", self.fixed_gain))
        fixed += (("W_o", "eye"),) if self.eye_out else ()
        return DiscoveredAdapter(self.to_state, self.from_state, self.held_at_zero, fixed, layout=self)

    def describe(self, spec: AttnSpec = DISPLAY) -> list[str]:
        """One line per mapping, ``W_q <- c_attn.weight[0:768]``, with sizes from ``spec``."""
        shapes = canonical_shapes(spec)
        lines = []
        for s in self.sources:
            if s.constant:
                value = {"eye": " = I", "zero": " = 0", "kept": ": kept as built"}[s.constant]
                lines.append(f"{s.param}{value} (fixed: {s.note})")
                continue
            if s.per_head:
                n = heads_of(s.canonical[0], spec)
                rows = shapes[s.canonical[0]][0] // n
                suffix = ".T" if s.transposed else ""
                lines.append(f"{s.canonical[0]}[{rows}*i:{rows}*(i+1)] <- {s.param}{suffix} for i in 0..{n - 1}")
                continue
            start = 0
            for name in s.canonical:
                rows = shapes[name][0]
                if len(s.canonical) == 1:
                    where = f"{s.param}{head_shaped.describe(s.heads_axis) if s.heads_axis else ''}"
                    where = f"{where}.T" if s.transposed else where
                else:
                    where = f"{s.param}[:, {start}:{start + rows}].T" if s.transposed else f"{s.param}[{start}:{start + rows}]"
                lines.append(f"{name} <- {where}" + (f" ({s.note})" if s.note and name.startswith("W") else ""))
                start += rows
        lines += [g.describe() for g in self.gains]
        if self.fixed_gain is not None:
            lines.append(f"g_q = g_k = {self.fixed_gain:.4g} (fixed: its QK-norm has no weights; measured, see above)")
        lines += self.low_rank.describe() if self.low_rank is not None else []
        lines += ["W_o = I (fixed: the module has no output projection at these sizes)"] if self.eye_out else []
        lines += [f"bound by shape (no name says their role): {note}" for note in self.by_shape]
        lines += [f"q, k, v order: {self.qkv_order}"] if self.qkv_slots else []
        lines += [f"rows: {fused_order.NOTE}"] if self.fused_rows else []
        lines += ["query head h reads kv head h % kv_heads (measured): it holds canonical head (h % kv_heads) * "
                  "(num_heads // kv_heads) + h // kv_heads"] if self.kv_groups else []
        lines += [f"{n} = 0 (the module has no such parameter; the reference holds it at zero)" for n in sorted(self.held_at_zero)]
        lines += [f"{n}: not found (the constructor takes qkv_bias, but the module has no such bias)" for n in self.missing]
        return lines


@dataclass(frozen=True)
class DiscoveredAdapter(Adapter):
    """An :class:`~attnbench.weights.Adapter` found by :func:`discover` (``layout`` says how)."""

    layout: Layout | None = field(default=None, compare=False)


def heads_of(name: str, spec: AttnSpec) -> int:
    """How many heads canonical ``name`` is split into: keys and values have ``num_kv_heads`` where a spec has them."""
    return (getattr(spec, "num_kv_heads", None) or spec.num_heads) if name[-1] in "kv" else spec.num_heads


def _part(w: CanonicalWeights, name: str) -> torch.Tensor:
    """Canonical ``name``, or zeros for a bias the spec does not have (a module with biases always on)."""
    t = getattr(w, name)
    if t is None:
        t = torch.zeros_like(getattr(w, "W" + name[1:])[:, 0])
    return t


class MappingError(PluginLoadError):
    """No unambiguous layout: ``problems`` says why (the message also lists the parameters)."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class _NeedsSameWidth(Exception):
    """An ``nn.MultiheadAttention`` inside takes inputs of width embed_dim: the class needs d_in == d_out."""


@dataclass
class _Group:
    """Parameters that play one role: one tensor, or one per head (``names`` in head order)."""

    role: str
    kind: str  # weight | bias
    names: list[str]
    shapes: list[tuple[int, ...]]
    owner: str  # linear | conv1d | raw


def discover(module: nn.Module, spec: AttnSpec, has_qkv_bias: bool = True, shape: bool = True) -> Layout:
    """The :class:`Layout` of ``module`` built for ``spec`` (a probe whose sizes differ); raises
    :class:`PluginLoadError` listing the parameters when no unambiguous layout exists. ``shape``: what names leave
    unbound is bound by shape (:mod:`~attnbench.plugins.by_shape`)."""
    params = dict(module.named_parameters())  # frozen (requires_grad=False) weights are weights too
    modules = dict(module.named_modules())
    shapes = canonical_shapes(spec)
    sources: dict[str, Source] = {}
    claims: dict[str, list[str]] = defaultdict(list)  # canonical name -> params claiming it
    problems: list[str] = []

    def claim(src: Source, holder: str = "") -> None:
        sources[src.param] = src
        for name in src.canonical:
            if (holder or src.param) not in claims[name]:
                claims[name].append(holder or src.param)

    try:
        gains = find_gains(module, spec)
    except NormError as exc:
        gains = []
        problems.append(str(exc))
    gain_params = {g.param for g in gains}
    sinks = _find_sinks(params, spec)
    gain_params |= {sinks} - {""}
    low_rank = find_low_rank(modules, spec)
    if low_rank is not None:
        gain_params |= low_rank.params()
        for name, holder in (("W_k", low_rank.up_k), ("W_v", low_rank.up_v), ("b_k", low_rank.up_k), ("b_v", low_rank.up_v)):
            if name.startswith("W") or holder in low_rank.biases:
                claims[name].append(holder)
    mha_outs = _claim_multihead(modules, params, spec, shapes, claim)
    groups = _groups({n: p for n, p in params.items() if n not in sources and n not in gain_params}, modules)
    orient: dict[str, bool | None] = {}
    for g in groups:
        _claim_group(g, spec, shapes, claim, orient, problems)
    _hold_inner_out_proj(mha_outs, claims, sources)
    shaped = _claim_by_shape(params, modules, sources, claims, gain_params, spec, shapes, claim) \
        if shape and not problems else ()
    _measure_square(modules, sources, orient)
    _settle_square(sources, orient, problems)
    more = _claim_problems(claims, sources, params, gain_params, spec, bool(problems))
    eye_out = not problems and more == [NO_OUT]  # every parameter claimed, and no output projection: W_o = I
    problems += [] if eye_out else more
    if problems:
        raise MappingError(_mapping_error(module, params, spec, problems), problems)
    held, missing = _held_and_missing(claims, spec, has_qkv_bias)
    return Layout(tuple(sources.values()), frozenset(held), missing, gains=tuple(gains), low_rank=low_rank, sinks=sinks,
                  eye_out=eye_out, by_shape=tuple(f.note for f in shaped),
                  qkv_slots=next((f.qkv_slots for f in shaped if f.qkv_slots), ()))


def _covered(sources: dict[str, Source], spec: AttnSpec) -> set[str]:
    """The parameter names the sources set (a per-head template once per head)."""
    return {src.param.format(i=i) if src.per_head else src.param
            for src in sources.values() for i in range(heads_of(src.canonical[0], spec) if src.per_head else 1)}


def _claim_by_shape(params, modules, sources, claims, gain_params, spec, shapes, claim) -> tuple[by_shape.Found, ...]:
    """Claim what names left unbound, by shape (:mod:`~attnbench.plugins.by_shape`), and keep frozen scalars as built."""
    taken = _covered(sources, spec) | set(gain_params)
    missing = [n for n in ("W_q", "W_k", "W_v", "W_o") if not claims.get(n)]
    found = tuple(by_shape.bind(params, modules, taken, missing, shapes)) if missing else ()
    for f in found:
        for param, canonical in f.claims:
            claim(Source(param, canonical))
    for name in by_shape.kept_scalars(params, _covered(sources, spec) | set(gain_params)):
        claim(Source(name, constant="kept", note=f"a frozen scalar no canonical weight stands for, "
                                                 f"{params[name].item():.4g} as built on the probe"))
    return found


NO_OUT = "no parameter found for W_o"


SINK_NAMES = ("sinks", "sink", "attention_sinks", "attn_sinks", "sink_logits")
"""Parameter names (their last part) that hold the per-head attention-sink logits (issue 37; gpt-oss: ``sinks``)."""


def _find_sinks(params: dict, spec: AttnSpec) -> str:
    """The ``(num_heads,)`` parameter named like :data:`SINK_NAMES` when ``spec`` has sinks, else ``""``."""
    if not getattr(spec, "sinks", False):
        return ""
    found = [n for n, p in params.items() if n.rsplit(".", 1)[-1] in SINK_NAMES and tuple(p.shape) == (spec.num_heads,)]
    return found[0] if len(found) == 1 else ""


def _claim_group(g, spec: AttnSpec, shapes: dict, claim, orient: dict[str, bool | None], problems: list[str]) -> None:
    """Claim the canonical tensors one group of parameters (a weight or a bias, one or one per head) stands for, or
    add the problem that stops it."""
    canonical = _CANONICAL[g.role] if g.kind == "weight" else tuple("b" + n[1:] for n in _CANONICAL[g.role])
    rows = sum(shapes[n][0] for n in canonical)
    n = len(g.names)
    if n > 1 and (len(canonical) > 1 or n != heads_of(canonical[0], spec)):
        problems.append(f"{_template(g)} is a list of {n}, not one {'+'.join(canonical)} per head ({spec.num_heads} heads)")
        return
    if n == 1 and len(canonical) == 1 and _claim_heads_axis(g, spec, shapes[canonical[0]], claim):
        return
    if g.kind == "bias":
        if all(s == (rows // n,) for s in g.shapes):
            claim(Source(_template(g), canonical, per_head=n > 1), _template(g))
        else:
            problems.append(f"{_template(g)} has shape {g.shapes[0]}, expected ({rows // n},) for {'+'.join(canonical)}")
        return
    cols = shapes[canonical[0]][1]
    out_in, in_out = (rows // n, cols), (cols, rows // n)
    if not all(s in (out_in, in_out) for s in g.shapes) or len(set(g.shapes)) > 1:
        problems.append(f"{_template(g)} has shape {g.shapes[0]}, expected {out_in} or {in_out} for {'+'.join(canonical)}")
        return
    if out_in != in_out:
        transposed = g.shapes[0] == in_out
    else:
        transposed = {"linear": False, "conv1d": True}.get(g.owner)  # None: decided below
    orient[_template(g)] = transposed
    claim(Source(_template(g), canonical, per_head=n > 1, transposed=bool(transposed)), _template(g))


def _hold_inner_out_proj(mha_outs: list[str], claims: dict[str, list[str]], sources: dict[str, Source]) -> None:
    """An nn.MultiheadAttention followed by its own output projection: its out_proj is held at the identity."""
    if not mha_outs or len(claims["W_o"]) <= 1:
        return
    outer = [p for p in claims["W_o"] if p not in mha_outs]
    if len(outer) != 1:
        return
    for p in mha_outs:
        kind = "eye" if p.endswith("weight") else "zero"
        sources[p] = Source(p, constant=kind, shape=("d_out",) if kind == "zero" else ("d_out", "d_out"),
                            note=f"{outer[0]} is the output projection")
        for key in ("W_o", "b_o"):
            if p in claims[key]:
                claims[key].remove(p)


def _claim_problems(claims: dict[str, list[str]], sources: dict[str, Source], params: dict, gain_params: set[str],
                    spec: AttnSpec, had_problems: bool) -> list[str]:
    """What stops the claims from being a layout: a tensor claimed twice, a projection not found, a parameter with
    no canonical counterpart (the last two only when nothing else was wrong: they would follow from it)."""
    problems = [f"two candidate layouts for {name}: {' and '.join(holders)}"
                for name, holders in claims.items() if len(holders) > 1]
    for name in ("W_q", "W_k", "W_v", "W_o"):
        if not claims.get(name) and not (had_problems or problems):
            problems.append("no recognisable projections" if not claims else f"no parameter found for {name}")
    covered = _covered(sources, spec)
    unclaimed = [n for n in params if n not in covered and n not in gain_params]
    if unclaimed and not had_problems and problems in ([], [NO_OUT]):
        norms = _sublayer_norms(unclaimed)
        said = f" ({', '.join(norms)}: a norm of its own beyond q/k norms, so {SUBLAYER} (and residual), " \
               "not a bare attention layer)" if norms else ""
        if not norms and any(QK_NORM.search(n.rpartition(".")[0]) and n.endswith(".bias") for n in unclaimed):
            said = " (biases of its q/k norms: the reference's QK-norm has a gain and no bias)"
        problems = [*problems, f"no canonical counterpart for {', '.join(unclaimed)}{said}"]
    return problems


SUBLAYER = "a sublayer with its norm"
QK_NORM = re.compile(r"(^|[._])(q|k|query|key)_?(norm|ln|layer_?norm|rms_?norm)$", re.IGNORECASE)
"""A module path whose last part names a query or key norm (``q_norm``, ``k_ln``): never a sublayer's norm."""


def _sublayer_norms(names) -> list[str]:
    """The norm modules (:data:`NORM_OWNER`) that hold ``names``, q/k norms (:data:`QK_NORM`) left out."""
    owners = {n.rpartition(".")[0] for n in names}
    return sorted(o for o in owners if NORM_OWNER.search(o) and not QK_NORM.search(o))
NORM_OWNER = re.compile(r"(^|[._])(layer_?norm|norm|ln)(_?\w*)?$", re.IGNORECASE)
"""A module path whose last part names a norm (``layer_norm``, ``norm``, ``ln_1``): its parameters unmapped mean a
norm inside the class (FastSpeech2's and sgrvinod's sublayers: ``layer_norm(fc(out) + residual)``)."""


def _held_and_missing(claims: dict[str, list[str]], spec: AttnSpec, has_qkv_bias: bool) -> tuple[set[str], tuple[str, ...]]:
    """The canonical biases held at zero (the module has none) and those missing although the spec asks for them."""
    absent = [b for b in ("b_q", "b_k", "b_v") if not claims.get(b)]
    held = {"b_o"} if not claims.get("b_o") else set()
    missing: tuple[str, ...] = ()
    if spec.qkv_bias and absent:
        if has_qkv_bias:
            missing = tuple(absent)
        else:
            held |= set(absent)  # bias-free by design: the constructor cannot be asked for biases
    return held, missing


def _claim_multihead(modules, params, spec, shapes, claim) -> list[str]:
    """Claim the parameters of every ``nn.MultiheadAttention`` submodule; returns its out_proj's names."""
    outs: list[str] = []
    for path, m in modules.items():
        if not isinstance(m, nn.MultiheadAttention):
            continue
        p = f"{path}." if path else ""
        if m._qkv_same_embed_dim and m.embed_dim != spec.d_in:
            raise _NeedsSameWidth(f"{type(m).__name__} {path or '(root)'} takes inputs of width embed_dim={m.embed_dim}")
        if m.in_proj_weight is not None:
            claim(Source(p + "in_proj_weight", ("W_q", "W_k", "W_v")))
        for role, name in (("W_q", "q_proj_weight"), ("W_k", "k_proj_weight"), ("W_v", "v_proj_weight")):
            if getattr(m, name, None) is not None:
                claim(Source(p + name, (role,)))
        if m.in_proj_bias is not None:
            claim(Source(p + "in_proj_bias", ("b_q", "b_k", "b_v")))
        for extra in ("bias_k", "bias_v"):
            if getattr(m, extra, None) is not None:
                claim(Source(p + extra, constant="zero", shape=(1, 1, "d_out"),
                             note="nn.MultiheadAttention(add_bias_kv=True) adds a learned key/value token the "
                                  "canonical layer does not have; q/k/v biases are its bias=True"))
        claim(Source(p + "out_proj.weight", ("W_o",)))
        outs.append(p + "out_proj.weight")
        if m.out_proj.bias is not None:
            claim(Source(p + "out_proj.bias", ("b_o",)))
            outs.append(p + "out_proj.bias")
    return [o for o in outs if o in params]


def _groups(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> list[_Group]:
    """Parameters with a recognised role, grouped: one per projection, or one list per head."""
    by_key: dict[tuple, list[tuple[int, str]]] = defaultdict(list)
    info: dict[tuple, tuple[str, str, str]] = {}
    for name, p in params.items():
        tokens = name.split(".")
        if tokens[-1] in ("weight", "bias") and len(tokens) > 1:
            kind, search = tokens[-1], tokens[:-1]
            owner_mod = modules.get(".".join(tokens[:-1]))
            owner = "linear" if isinstance(owner_mod, nn.Linear) else \
                "conv1d" if type(owner_mod).__name__ == "Conv1D" else "raw"
        else:
            biased = p.dim() == 1 or (p.dim() == 2 and re.match(r"_?(b|bias)_", tokens[-1]) is not None)  # b_Q
            kind, search, owner = ("bias" if biased else "weight"), tokens, "raw"
        role = next((r for r in (role_of(t) for t in reversed(search) if not t.isdigit()) if r), None)
        if role is None or p.dim() > 3 or (p.dim() == 3 and owner != "raw"):
            continue
        numeric = [i for i, t in enumerate(tokens) if t.isdigit()]
        key = (role, kind, ".".join("*" if t.isdigit() else t for t in tokens))
        by_key[key].append((tuple(int(tokens[i]) for i in numeric), name))
        info[key] = (role, kind, owner)
    groups = []
    for key, members in by_key.items():
        members.sort()
        if len(members) > 1:  # one per head: the varying index orders them
            heads = [m[0][-1] for m in members]
            if heads != list(range(len(members))):
                continue
        names = [m[1] for m in members]
        role, kind, owner = info[key]
        groups.append(_Group(role, kind, names, [tuple(params[n].shape) for n in names], owner))
    return groups


def _claim_heads_axis(g: _Group, spec: AttnSpec, shape: tuple[int, ...], claim) -> bool:
    """Claim one raw parameter that holds a canonical q/k/v/o matrix or bias with a heads axis of its own
    (:mod:`~attnbench.plugins.head_shaped`); False when its shape is not so."""
    name = g.names[0]
    canonical = _CANONICAL[g.role] if g.kind == "weight" else tuple("b" + c[1:] for c in _CANONICAL[g.role])
    heads = heads_of(canonical[0], spec)
    if g.kind == "bias":
        how, transposed = head_shaped.mode(g.shapes[0], shape[0], None, heads), False
    elif canonical == ("W_o",):  # the heads axis is W_o's input: read transposed
        how, transposed = head_shaped.mode(g.shapes[0], shape[1], shape[0], heads), True
    else:
        how, transposed = head_shaped.mode(g.shapes[0], shape[0], shape[1], heads), False
    if not how or (g.kind == "bias" and g.role == "o"):
        return False
    claim(Source(name, canonical, transposed=transposed, heads_axis=how), name)
    return True


def _template(g: _Group) -> str:
    return re.sub(r"\.\d+(\.|$)", r".{i}\1", g.names[0]) if len(g.names) > 1 else g.names[0]


def _measure_square(modules: dict[str, nn.Module], sources: dict[str, Source], orient: dict[str, bool | None]) -> None:
    """Square weights whose orientation names cannot say, measured where a submodule of their own applies them
    (THUMT's ``Affine``: ``F.linear(x, self.weight, self.bias)``): is what it adds to its output ``x @ W.T`` or
    ``x @ W``? A weight the class applies itself stays undecided."""
    for name, transposed in list(orient.items()):
        path, _, last = name.rpartition(".")
        owner = modules.get(path) if path else None
        weight = getattr(owner, last, None) if owner is not None else None
        if transposed is not None or name not in sources or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
        try:
            with torch.no_grad():
                moved = owner(x) - owner(torch.zeros_like(x))
        except Exception:  # noqa: BLE001 - a submodule that is not a projection: undecided
            continue
        with torch.no_grad():
            fits = [torch.allclose(moved, x @ w, rtol=1e-4, atol=1e-5) for w in (weight.t(), weight)]
        if fits.count(True) == 1:
            orient[name] = fits[1]
            how = "(in, out): its module adds x @ W" if fits[1] else "(out, in): its module adds x @ W.T"
            sources[name] = replace(sources[name], transposed=fits[1], note=f"stored {how}, measured")


def _settle_square(sources: dict[str, Source], orient: dict[str, bool | None], problems: list[str]) -> None:
    """Raw square matrices follow the orientation of the class's q/k/v projections (when those say one): their own,
    or their heads axis's reading (``(heads, d_model, d_head)``, as ``x @ W``: alan-cooney's and TransformerLens's
    ``W_O`` is then ``(in, out)`` too)."""
    undecided = [n for n, t in orient.items() if t is None]
    if not undecided:
        return
    qkv = {t for n, t in orient.items() if t is not None and sources[n].canonical != ("W_o",)}
    qkv |= {s.heads_axis == "in_head" for s in sources.values()
            if s.heads_axis and s.canonical[0] in ("W_q", "W_k", "W_v")}
    if len(qkv) != 1:
        problems.append(f"cannot tell whether {', '.join(undecided)} {'is' if len(undecided) == 1 else 'are'} stored "
                        "(out, in) or (in, out): the shapes are square (a constructor with one width)")
        return
    for n in undecided:
        sources[n] = replace(sources[n], transposed=next(iter(qkv)))


def _mapping_error(module: nn.Module, params, spec: AttnSpec, problems: list[str]) -> str:
    listed = ", ".join(f"{n} {tuple(p.shape)}" for n, p in params.items()) or "none"
    norms = _sublayer_norms(params)
    from attnbench.plugins.roles import whole_block

    block = whole_block(module, spec) if norms else None
    if block is not None:  # norms and an MLP around an attention child: a block, the first true cause
        return (f"{type(module).__name__} is a whole block, not an attention layer: {block}; check the attention "
                "class itself (FILE:Class)")
    if any(SUBLAYER in p for p in problems) and norms:  # the first true cause: a sublayer, not an unmapped name
        return (f"{type(module).__name__} is a sublayer with a norm of its own ({', '.join(norms)}), not a bare "
                f"attention layer: {'; '.join(problems)}. Its parameters at d_in={spec.d_in}, d_out={spec.d_out}, "
                f"num_heads={spec.num_heads}: {listed}. Check the attention without its norm and residual: "
                f"`attnbench adapt FILE:Class` writes an adapter to start from ({GUIDE})")
    first, first_shape = next(((n, tuple(p.shape)) for n, p in params.items() if p.dim() == 2), ("qkv.weight", ()))
    shapes = canonical_shapes(spec)
    fused = (sum(shapes[n][0] for n in ("W_q", "W_k", "W_v")), spec.d_in)
    value = {shapes["W_q"]: "w.W_q", shapes["W_q"][::-1]: "w.W_q.T", fused: "torch.cat([w.W_q, w.W_k, w.W_v])",
             fused[::-1]: "torch.cat([w.W_q, w.W_k, w.W_v]).T"}.get(first_shape, "w.W_q")
    return (f"cannot map {type(module).__name__}'s parameters onto the canonical W_q, W_k, W_v, W_o: {'; '.join(problems)}. "
            f"Its parameters at d_in={spec.d_in}, d_out={spec.d_out}, num_heads={spec.num_heads}: {listed}. "
            "Name them like q_proj/W_query, qkv/c_attn/in_proj, out_proj/c_proj, or give the class "
            "`weight_adapter = attnbench.Adapter(to_state, from_state)` with e.g. "
            f"to_state = lambda w, spec: {{'{first}': {value}, ..., 'out.weight': w.W_o}} ({GUIDE})")


_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttnSpec)}
_REFUSED = {"rope_scaling": "it builds its own rotary tables unscaled",
            "norm_eps": f"its q/k norms keep their own epsilon; the spec's is {_SPEC_DEFAULTS['norm_eps']:g} by default"}
"""Why a class cannot apply a spec field it does not take (``PluginFactory.refuses``: a value other than the default)."""


class PluginFactory:
    """A user's constructor (bound by :mod:`~attnbench.plugins.binding`) whose modules carry a discovered
    weight layout as ``weight_adapter`` (unless they bring their own)."""

    def __init__(self, binding, has_qkv_bias: bool, context=None, requires: tuple[str, ...] = (),
                 refuses: tuple[str, ...] = (), own: dict | None = None) -> None:
        self.binding = binding
        self.own = dict(own or {})  # what the class always does, measured: norm_eps, even_head_dim (a reason)
        self.requires = requires  # spec fields the class always applies (its own RoPE, QK-norm with no switch)
        self.refuses = refuses  # spec fields it cannot apply beyond its capabilities (its own RoPE unscaled)
        self.context = context  # a plugins.context.ContextPlan: forward takes its mask, rotary tables, cache
        self.has_qkv_bias = has_qkv_bias
        self._layouts: dict[bool, Layout] = {}
        self._qkv_roles: tuple[int, ...] | None = None  # three unnamed q/k/v projections: their measured order
        self._qkv_why = ""  # why the probe could not order them
        self.evidence: list[str] = []  # what was inferred about the class and why (plugins.inference), for check -v
        self.imported = ""  # how its file was imported (plugins.loading.how_imported), for check -v
        self.form = None  # what its forward takes and does before its projections, probed once (plugins.forms)
        self.__name__ = f"{getattr(binding.target, '__name__', 'plugin')}_factory"

    def own_spec(self, spec: AttnSpec, qk_norm: tuple[str, ...] = ()) -> AttnSpec:
        """``spec`` as this class computes it: what it always applies filled in (its QK-norm in its placement
        ``qk_norm[0]``, RoPE at theta 10,000 when the spec has none) and its own measured norm epsilon; raises
        :class:`UnavailableError` (:data:`OWN_CONSTRAINT`) for a spec it cannot take (an odd head dim)."""
        name = getattr(self.binding.target, "__qualname__", "the class")
        fill = {}
        if "rope_theta" in self.requires and spec.rope_theta is None and spec.head_dim % 2:
            raise UnavailableError(f"{name} needs an even head dim, not {spec.head_dim}: it always applies its own "
                                   f"rotary embeddings ({OWN_CONSTRAINT})")
        own_theta = self.own.get("rope_theta")  # a base of its own, measured (plugins.own_rope)
        if own_theta is not None and spec.rope_theta not in (None, own_theta):
            raise UnavailableError(f"{name} always rotates with its own theta {own_theta:g} (measured), not "
                                   f"{spec.rope_theta:g} ({OWN_CONSTRAINT})")
        for f in self.requires:
            if getattr(spec, f, None) is None:
                fill[f] = (own_theta or 10000.0) if f == "rope_theta" else (qk_norm or ("head",))[0]
        if "rope_theta" in fill and "rope_style" in self.own:  # its own pairs (GPT-J's interleaved), measured
            fill["rope_style"] = self.own["rope_style"]
        spec = replace(spec, **fill) if fill else spec
        if "norm_eps" in self.own and spec.qk_norm is not None and spec.norm_eps != self.own["norm_eps"]:
            spec = replace(spec, norm_eps=self.own["norm_eps"])
        if self.own.get("rope_sign", 1) != 1 and spec.rope_theta is not None and spec.rope_sign == 1:
            spec = replace(spec, rope_sign=self.own["rope_sign"])  # its pairs turn the other way (plugins.measured)
        if spec.context_length > self.own.get("max_len", spec.context_length):
            raise UnavailableError(f"{name} takes at most {self.own['max_len']} tokens, not a context of "
                                   f"{spec.context_length} ({OWN_CONSTRAINT}: nothing it takes sets its length)")
        if self.own.get("encoder") and spec.causal:  # an encoder's attention (plugins.encoder): what it computes
            spec = replace(spec, causal=False)
        if self.own.get("heads") == 1 and spec.num_heads != 1:
            raise UnavailableError(f"{name} always has one head, not {spec.num_heads} ({OWN_CONSTRAINT})")
        if self.own.get("kv_heads") == 1 and (spec.num_kv_heads or spec.num_heads) != 1:
            raise UnavailableError(f"{name} always has one key/value head (multi-query), not "
                                   f"{spec.num_kv_heads or spec.num_heads} ({OWN_CONSTRAINT})")
        if "even_head_dim" in self.own and spec.head_dim % 2:
            raise UnavailableError(f"{name} needs an even head dim, not {spec.head_dim}: it always rotates q and k by "
                                   f"pairs ({OWN_CONSTRAINT}; a probe at head_dim 3 raised {self.own['even_head_dim']})")
        return spec

    def _for_constructor(self, spec: AttnSpec) -> AttnSpec:
        """``spec`` in the class's own conventions: a window that counts the current token apart gets ``N - 1``."""
        if not self.own.get("window_offset") or spec.window is None:
            return spec
        if spec.window == 1:
            raise UnavailableError(f"{getattr(self.binding.target, '__qualname__', 'the class')}'s window counts the "
                                   f"current token apart: a window of one key would be window=0 for it ({OWN_CONSTRAINT})")
        return replace(spec, window=spec.window - 1)

    def refuse_form(self) -> None:
        """Raise, once probed (:mod:`~attnbench.plugins.forms`), why the class is no bare sequence attention layer: it
        takes images, or norms its input before its projections. The first build probes, never the plug-in's load."""
        if self.form is None:
            from attnbench.plugins.measured import _bounded

            probe = replace(self.binding.probe, num_kv_heads=self.own.get("kv_heads"))
            try:
                probe = self.own_spec(probe)
            except UnavailableError:  # the probe's sizes are not the class's: the cases show what it does
                self.form = False
                return
            guard = _bounded(SimpleNamespace(), forms.PROBE_S)  # its own: a slow probe here stops no measured one
            self.form = forms.probe_class(self.binding, self.context, probe, guard) or False
        if self.form:
            raise self.form.error(getattr(self.binding.target, "__qualname__", "the class"))

    def __call__(self, spec: AttnSpec) -> nn.Module:
        self.refuse_form()  # the first true cause, before its weights are mapped or any case runs
        spec = self.own_spec(spec)  # what the class always applies is filled in: no spec lacks it any more
        refused = [f for f in self.refuses if getattr(spec, f) != _SPEC_DEFAULTS[f]]
        if refused:
            raise UnavailableError(f"{getattr(self.binding.target, '__qualname__', 'the class')} takes no "
                                   + "; no ".join(f"{f} ({_REFUSED[f]})" for f in refused))
        module = self.binding(self._for_constructor(spec))
        if not isinstance(module, nn.Module):
            return module
        if self.context is not None:
            bind_context(module, self.context, spec)
        module.register_forward_hook(_first_of_tuple)
        if not isinstance(getattr(module, "weight_adapter", None), Adapter):
            object.__setattr__(module, "weight_adapter", self.layout(spec, module).adapter())
        return module

    def layout(self, spec: AttnSpec, module: nn.Module) -> Layout:
        """The layout of ``module`` (built for ``spec``), discovered once per bias setting (and for grouped-query
        specs, whose keys and values are narrower) on the probe spec."""
        gqa = spec.num_kv_heads not in (None, spec.num_heads) or self.own.get("kv_heads") == 1  # k, v narrower than q
        qk_norm = getattr(spec, "qk_norm", None)
        sinks = bool(getattr(spec, "sinks", False))  # issue 37: a (num_heads,) sink parameter exists only then
        key = (spec.qkv_bias, gqa, qk_norm, sinks)
        if key not in self._layouts:
            probe = replace(self.binding.probe, qkv_bias=spec.qkv_bias,
                            num_kv_heads=(self.own.get("kv_heads") or GQA_PROBE_KV_HEADS) if gqa else None,
                            qk_norm=qk_norm, sinks=sinks,  # own kv_heads: multi-query by construction
                            rope_theta=spec.rope_theta)  # a class that always rotates builds its tables with it
            try:
                probe_module = self.binding(probe)
            except Exception:  # the class refuses the probe's sizes: read the layout off the module itself
                return self._ordered(self._discover(module, spec))
            found = self._ordered(self._discover(probe_module, probe))  # never cached unordered: a refusal every time
            found = self._fused_rows(found, probe)
            self._layouts[key] = self._grouped(found, probe) if gqa else found
        layout = self._layouts[key]
        params = dict(module.named_parameters())
        if any(s.param not in params for s in layout.sources if not s.per_head and not s.constant):  # another shape at these sizes
            layout = replace(self._ordered(self._discover(module, spec)), kv_groups=layout.kv_groups,
                             fused_rows=layout.fused_rows)
        if layout.same_width_reason and spec.d_in != spec.d_out:
            raise UnavailableError(f"{self.binding.describe()} needs d_in == d_out: {layout.same_width_reason}")
        if layout.square_only_problem and spec.d_in != spec.d_out:
            raise PluginLoadError(f"{type(module).__name__}'s parameters do not fit d_in={spec.d_in} != d_out={spec.d_out} "
                                  f"(they do when d_in == d_out): {layout.square_only_problem}")
        return layout

    def _ordered(self, layout: Layout) -> Layout:
        """``layout`` with three (or four) unnamed projections ordered by what each does, measured once on the plain
        probe (:func:`~attnbench.plugins.by_shape.qkv_roles`); a :class:`MappingError` when the probe cannot tell."""
        if not layout.qkv_slots:
            return layout
        plain = replace(self.binding.probe, qkv_bias=False, num_kv_heads=None)
        if self._qkv_roles is None:
            try:
                module = self.binding(plain).double().eval()
                plain_layout = self._discover(module, plain)
                bound = bind_context(module, self.context, plain) if self.context is not None else module
                self._qkv_roles = by_shape.qkv_roles(lambda w, x: _loaded_output(module, bound, plain_layout, w, x, plain),
                                                     plain, len(layout.qkv_slots)) or ()
                self._qkv_why = "no slot alone behaves as a query, key or value projection does"
            except Exception as exc:  # noqa: BLE001 - named in the refusal
                self._qkv_roles, self._qkv_why = (), f"the probe raised {type(exc).__name__}: {exc}"
        if not self._qkv_roles:
            detail = (f"bound by shape ({'; '.join(layout.by_shape)}), but a probe of what each does could not tell "
                      f"which is which: {self._qkv_why}")
            try:
                discover(self.binding(plain), plain, self.has_qkv_bias, shape=False)
            except MappingError as exc:
                raise MappingError(f"{exc} ({detail})", exc.problems) from None
            raise MappingError(detail, [detail])
        sources, how = by_shape.assign(layout.sources, layout.qkv_slots, self._qkv_roles)
        return replace(layout, sources=sources, qkv_order=how)

    def _grouped(self, layout: Layout, probe: AttnSpec) -> Layout:
        """``layout`` with the order in which the class's query heads read its kv heads (:mod:`~attnbench.plugins.heads`)."""
        return replace(layout, kv_groups=heads.measure(self._runner(probe), layout.to_state, probe))

    def _fused_rows(self, layout: Layout, probe: AttnSpec) -> Layout:
        """``layout`` with its fused q/k/v rows per kv head when a probe measures them so (:mod:`~attnbench.plugins.fused_order`)."""
        fused = [s for s in layout.sources if s.canonical == fused_order.FUSED[0] and not s.per_head]
        if not fused:
            return layout
        rows = None
        for spec in (probe, replace(probe, rope_theta=10000.0)):  # zero biases (the probe weights); the tables' theta
            rows = fused_order.measure(self._runner(spec), layout.to_state, spec, heads._probe_weights(spec))
            if rows is not None:
                break
        return replace(layout, fused_rows=rows or "")

    def _runner(self, probe: AttnSpec):
        """``run(state, x)``: the class built at ``probe`` in eval mode, ``state`` loaded, its context bound, on ``x``."""
        def run(state, x):
            module = self.binding(probe).eval()
            params = dict(module.named_parameters())
            for name, value in state.items():
                params[name].copy_(value)
            return (bind_context(module, self.context, probe) if self.context is not None else module)(x)

        return run

    def _discover(self, module: nn.Module, spec: AttnSpec) -> Layout:
        layout = self._discover_weights(module, spec)
        return replace(layout, fixed_gain=self.own["fixed_gain"]) if "fixed_gain" in self.own else layout

    def _discover_weights(self, module: nn.Module, spec: AttnSpec) -> Layout:
        if spec.d_in == spec.d_out:
            try:
                return discover(module, spec, self.has_qkv_bias)
            except _NeedsSameWidth as exc:
                raise PluginLoadError(f"cannot map {type(module).__name__}: {exc}, not d_in={spec.d_in}") from exc
        square = replace(SQUARE_PROBE, qkv_bias=spec.qkv_bias)
        try:
            return discover(module, spec, self.has_qkv_bias)
        except _NeedsSameWidth as exc:
            return replace(discover(self.binding(square), square, self.has_qkv_bias), same_width_reason=str(exc))
        except MappingError as exc:  # right only when d_in == d_out? Then the d_in != d_out cases show it.
            try:
                layout = discover(self.binding(square), square, self.has_qkv_bias)
            except Exception:
                raise exc from None
            return replace(layout, square_only_problem="; ".join(exc.problems))


def _loaded_output(module: nn.Module, bound, layout: Layout, w: CanonicalWeights, x: torch.Tensor,
                   spec: AttnSpec) -> torch.Tensor:
    """``bound(x)`` (``module`` with its context bound) after loading ``w`` through ``layout``."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in layout.to_state(w, spec).items():
            params[name].copy_(value)
        out = bound(x)
    return out[0] if isinstance(out, tuple | list) else out


def _first_of_tuple(module: nn.Module, args, output):
    """A forward that returns ``(output, attention_weights)`` (Hugging Face style) is read as its output."""
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return output


OWN_CONSTRAINT = "the class's own constraint"
"""In the reason of a case skipped because of what the class always does (``check``'s coverage line counts them)."""


def with_layout(binding, has_qkv_bias: bool, context=None, requires: tuple[str, ...] = (),
                refuses: tuple[str, ...] = (), own: dict | None = None) -> PluginFactory:
    """``binding`` as an implementation factory whose modules carry their discovered weight layout (and, with a
    :class:`~attnbench.plugins.context.ContextPlan`, get their forward's context bound)."""
    return PluginFactory(binding, has_qkv_bias, context, requires, refuses, own)


def preflight(impl, device: str = "cpu", other_specs=()) -> list[str]:
    """Build ``impl`` and load canonical weights once per bias setting, before any case runs.

    Tries the probe specs, then ``other_specs`` (the sizes the cases will use): a class that builds and
    maps for any of them goes on to the cases, which show where it fails. Returns the lines
    ``attnbench check -v`` prints (constructor call and weight mapping); raises the
    :class:`~attnbench.errors.AttnbenchError` of a failed import, construction or mapping.
    """
    factory = impl.factory
    lines = [f"constructor: {factory.binding.describe()}"] if isinstance(factory, PluginFactory) else []
    lines += [factory.imported] if getattr(factory, "imported", "") else []
    lines += [line if line.endswith("attnbench_capabilities)") or line.startswith(("config fields", "bound ")) else f"inferred {line}"
              for line in getattr(factory, "evidence", ())]
    dtype = "float32" if "float32" in impl.dtypes else impl.dtypes[0]
    mla = bool(getattr(factory, "mla", False))  # issue 46: DeepSeek MLA has no q/k/v biases (the spec forbids them)
    for qkv_bias in (False,) if mla else (False, True):
        module, first_error = None, None
        one_kv = tuple(replace(p, num_kv_heads=1) for p in (PROBE, SQUARE_PROBE)) if impl.gqa else ()  # multi-query by construction
        for spec in (PROBE, SQUARE_PROBE, *other_specs, *one_kv):
            if impl.same_width_only and spec.d_in != spec.d_out:
                continue
            spec = replace(spec, qkv_bias=qkv_bias)  # build fills what the class always applies (own_spec)
            try:
                module = impl.build(spec, device, dtype, weights=random_weights(spec))
                break
            except (UnavailableError, PluginLoadError) as exc:  # right only for some sizes? The cases show it.
                first_error = first_error or exc
        if module is None:
            raise first_error
        adapter = getattr(getattr(module, "_orig_mod", module), "weight_adapter", None)
        if isinstance(adapter, DiscoveredAdapter) and adapter.layout is not None:
            lines.append(f"weights (qkv_bias={qkv_bias}, shown for d_in=d_out={DISPLAY.d_out}, {DISPLAY.num_heads} heads):")
            one = 1 if getattr(factory, "own", {}).get("kv_heads") == 1 else None  # multi-query by construction
            lines += [f"  {line}" for line in adapter.layout.describe(replace(DISPLAY, qkv_bias=qkv_bias, num_kv_heads=one))]
    return lines + groups_line(impl, dtype)


def groups_line(impl, dtype: str) -> list[str]:
    """What ``check -v`` says of a grouped-query class whose query heads read their kv heads in another order."""
    if not (impl.gqa and isinstance(impl.factory, PluginFactory)):
        return []
    spec = replace(SQUARE_PROBE, num_kv_heads=GQA_PROBE_KV_HEADS)
    try:
        layout = impl.build(spec, "cpu", dtype).weight_adapter.layout
    except Exception:  # the GQA cases show what it does
        return []
    return [KV_ORDER_NOTE] if getattr(layout, "kv_groups", "") else []


KV_ORDER_NOTE = ("kv order: query head h reads kv head h % kv_heads, not h // (num_heads // kv_heads) (measured: each kv "
                 "head's values set to its number, W_q = W_k = 0, W_o = I); its grouped cases load the weights with the "
                 "query heads reordered, the same function up to that order. Weights in Llama/HF order "
                 "(repeat_interleave) load wrong into it: if that is what it must hold, `repeat` stands where "
                 "`repeat_interleave` was meant")
"""The finding ``check`` prints for a class whose query heads read their kv heads strided (:mod:`plugins.heads`), and
the note on each of its grouped-query cases: a convention (x-transformers' einops ``(r kvh)``) or a bug (a port of
Llama that expands with ``repeat``), which only the class's author can tell."""
