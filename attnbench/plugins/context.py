"""Forwards that take their context as arguments: ``forward(x, mask, cos, sin, start_pos=0, cache=None)``.

The book's chapter-5 layers (Llama 3.2, Qwen3, Gemma 3, OLMo 3) and most model code take the mask, the
rotary tables, the start position and the KV cache from their caller. attnbench is that caller: the names of
``forward``'s parameters say what each is, and the module is rebound once, at build time, to a
``forward(x, use_cache=False)`` (plus ``reset_cache()`` when it has a cache) that the runner, the correctness
matrix and the decode timer call as they call every other implementation:

* ``mask`` / ``attn_mask`` / ``attention_mask``: the step's ``(T_new, T_total)`` mask, causal or windowed as
  the spec says, in the form the class reads. The form (the book's bool mask with True = hidden, a bool
  keep-mask, or an additive float mask; 2-D or ``(1, 1, T_new, T_total)``) is decided by a probe that never
  compares with the reference: with the right form, changing the last token leaves every earlier output
  unchanged and changes the last one (:func:`probe_mask`);
* ``cos`` / ``sin``, ``position_embeddings=(cos, sin)`` (rotate-half tables, Llama/HF) and ``freqs_cis``
  (complex, interleaved pairs, Meta): the spec's RoPE tables (neutral, cos = 1 and sin = 0, when the spec has
  no RoPE). A class that also takes a position gets ``(context_length, head_dim)`` tables to index itself;
  one that takes no position gets the rows of the step's positions;
* ``start_pos`` / ``input_pos`` (an int), ``position_ids`` (``(1, T_new)``), ``cache_position`` (``(T_new,)``):
  the absolute position of the step's first token;
* ``cache`` / ``kv_cache`` / ``past_key_value(s)`` / ``layer_past``: the cache the previous step returned
  (``None`` after a reset); the class returns ``(out, next_cache)``, and a ``use_cache`` parameter gets True
  while decoding.

A required parameter attnbench cannot supply is one :class:`~attnbench.errors.PluginLoadError` naming it
and what is supplied, raised when the plug-in loads (never one failure per case).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, replace

import torch
from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.plugins import signatures
from attnbench.plugins.cache_objects import LayerCache, cache_object_for
from attnbench.plugins.helper_args import build_helper, module_class
from attnbench.plugins.module_cache import AppendingCache, build_own_cache, describe_attr_cache
from attnbench.plugins.outputs import output_first
from attnbench.spec import AttnSpec

MASK_NAMES = ("mask", "attn_mask", "attention_mask", "causal_mask", "attn_bias", "attention_bias")  # forms: probed
TABLE_NAMES = ("cos", "sin", "position_embeddings", "cos_sin", "freqs_cos", "freqs_sin")
"""Rotary tables by name: rotate-half ``cos``/``sin`` (or a pair), llama2.c's per-frequency ``freqs_cos``/``freqs_sin``.
A table of each frequency's rotation under any other name (Meta's ``freqs_cis``, lit-llama's ``rope``, flux's ``pe``)
is an argument no name tells: the causal probe gives it tables, complex, real ``(..., 2)`` or rotation matrices."""
PAIR_NAMES = ("position_embeddings", "cos_sin")
TABLE_DIMS = {"": "(T, head_dim), a pair (1, T, head_dim)", "3d": "(1, T, head_dim)", "4d": "(1, 1, T, head_dim)",
              "seq_half": "(1, T, 1, head_dim/2), each frequency once", "2d": "(T, head_dim), a pair too",
              "wide": "(T, head_dim), each frequency twice in a row"}
"""The shapes cos/sin tables can be given in (``""``: the default, tried first); a probe decides. ``wide`` is for
``freqs_cos``/``freqs_sin`` only: llama2.c's per-frequency tables repeated for each of a pair's two features
(``torch.cos(freqs).repeat_interleave(2, dim=-1)``)."""
POSITION_NAMES = {"start_pos": "int", "input_pos": "int", "position_ids": "ids (1, T)", "cache_position": "ids (T,)"}
LENGTH_NAMES = ("max_seq_length", "max_seq_len", "context_length", "block_size", "max_len", "seq_len_max")
"""A forward-level context length (lit-llama's ``max_seq_length``): the spec's ``context_length``."""
SPAN_ARGS = ("input_pos_maxp1",)
"""The end of the filled part of a preallocated cache (litgpt): ``start + T_new`` while decoding, else None."""
CAUSAL_ARGS = ("is_causal", "causal")
"""A forward-level causal flag: the spec's causality when attnbench passes no mask, else False (the mask says it)."""
WINDOW_ARGS = ("window_size",)
"""A forward-level flash-attention window: ``(left, right)``, ``-1`` = unlimited (``(w - 1, 0)`` for a causal window w)."""
CACHE_NAMES = ("cache", "kv_cache", "past_key_value", "past_key_values", "layer_past")
KNOWN_NAMES = frozenset({*MASK_NAMES, *TABLE_NAMES, *POSITION_NAMES, *CACHE_NAMES, "use_cache", *WINDOW_ARGS,
                         *CAUSAL_ARGS, *SPAN_ARGS, *LENGTH_NAMES})
"""Every forward parameter name attnbench supplies by its name (any other is probed: plugins.causal_probe,
plugins.cache_probe)."""
GUIDE = "docs/own-attention.md: Forwards that take their context"
SUPPLIED = ("mask/attn_mask/attention_mask; cos, sin, position_embeddings=(cos, sin), cos_sin, freqs_cos/freqs_sin; "
            "start_pos/input_pos/position_ids/cache_position; cache/kv_cache/past_key_value(s)/layer_past; use_cache; "
            "is_causal; window_size; any other tensor: None, x again, position ids or rotary tables, by a probe")
"""What attnbench supplies by name; a required argument it cannot supply (a tensor none of the probed forms fits, or
another type) is refused with this list."""


@dataclass(frozen=True)
class MaskForm:
    """How a class reads its mask: ``hidden`` (bool, True = hidden), ``keep`` (bool, True = attend) or
    ``additive`` (float, 0 or -inf), ``keep_float`` (float, 1 = attend, 0 = hidden: BERT's ``attention_mask``, which
    the class turns into ``(1 - mask) * min`` itself); ``dims`` 2 for ``(T_new, T_total)``, 4 for ``(1, 1, T_new, T_total)``, 3 for
    ``(1, T_new, T_total)``, :data:`BATCHED` for ``(B, T_new, T_total)``."""

    kind: str
    dims: int = 2

    def make(self, hidden: torch.Tensor, dtype: torch.dtype, batch: int = 1) -> torch.Tensor:
        m = hidden if self.kind == "hidden" else ~hidden if self.kind == "keep" else \
            (~hidden).to(dtype) if self.kind == "keep_float" else \
            torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden, float("-inf"))
        if self.dims == BATCHED:  # one per batch row, a real copy: such a class may view or repeat it
            return m[None].repeat(batch, 1, 1)
        if self.dims == BATCHED_HEADS:  # Hugging Face's (bsz, 1, q_len, kv_len), checked by its size
            return m[None, None].repeat(batch, 1, 1, 1)
        if self.dims == PADDING:  # a key padding mask: the last query's row, which hides no key of a causal mask
            return m[-1][None].repeat(batch, 1)
        return m[None, None] if self.dims == 4 else m[None] if self.dims == 3 else m

    def describe(self) -> str:
        words = {"hidden": "bool, True = hidden (the book's)", "keep": "bool, True = attend",
                 "additive": "additive float, -inf = hidden", "keep_float": "float, 1 = attend, 0 = hidden"}[self.kind]
        return f"{words}, {SHAPES[self.dims]}"


BATCHED = -3
"""``MaskForm.dims`` of a ``(B, T_new, T_total)`` mask, one per batch row (sooftware/attentions, diffusers: a class that
repeats or views it per head and refuses to broadcast)."""
BATCHED_HEADS = -4
"""``MaskForm.dims`` of a ``(B, 1, T_new, T_total)`` mask (Hugging Face's eager attention checks that size)."""
PADDING = -5
"""``MaskForm.dims`` of a ``(B, T_total)`` key padding mask that hides no key: a class that masks the future itself and
requires its caller's padding mask (d3rlpy's ``attention_mask.view(B, 1, 1, T) * -10000``). Its content says nothing
of the future, so such a class takes no window or non-causal spec by its mask."""
SHAPES = {PADDING: "(B, T_total), a padding mask hiding no key",
          2: "(T_new, T_total)", 3: "(1, T_new, T_total), broadcast over the batch", 4: "(1, 1, T_new, T_total)",
          BATCHED: "(B, T_new, T_total), one per batch row", BATCHED_HEADS: "(B, 1, T_new, T_total), one per batch row"}
MASK_FORMS = tuple(MaskForm(k, d) for d in (2, 4, 3, BATCHED, BATCHED_HEADS, PADDING) for k in ("hidden", "keep", "additive",
                                                                                         "keep_float"))


@dataclass(frozen=True)
class ContextPlan:
    """What ``forward`` takes besides ``x``, by parameter name, and in which form attnbench supplies it."""

    target: str
    x: str
    mask: str | None = None
    tables: tuple[str, ...] = ()
    position: str | None = None
    cache: str | None = None
    use_cache: bool = False
    mask_form: MaskForm | None = None
    full_tables: bool = False  # (context_length, head_dim) tables the class indexes at its position
    attr_cache: str | None = None  # an attribute the forward reads a caller-installed cache from (plugins.module_cache)
    cache_builder: str | None = None  # the class's method that builds its own such cache (plugins.module_cache)
    span_arg: str | None = None  # the end of a preallocated cache's filled part (SPAN_ARGS)
    nones: tuple[str, ...] = ()  # required arguments the class runs causally without: None (plugins.causal_probe)
    falses: tuple[str, ...] = ()  # required bool flags (lag-llama's use_kv_cache): False, the plainest call
    seq_lengths: tuple[str, ...] = ()  # (B,) lengths of the sequences (no padding): every key so far (causal_probe)
    cache_default: bool = False  # the cache parameter defaults to a value of its own (an empty tensor): kept when empty
    window_arg: str | None = None  # a (left, right) window argument (WINDOW_ARGS)
    position_optional: bool = False  # the position defaults to None: None outside decoding may be what it expects
    position_none: bool = False  # None outside decoding (a class that reads a position as "use the cache"), by a probe
    table_dims: str = ""  # cos/sin shape (TABLE_DIMS), decided by a probe
    table_form: str = "complex"  # freqs_cis: "complex" (Meta), "real" (..., head_dim // 2, 2) (gpt-fast) or "matrix"
    # (..., head_dim // 2, 2, 2) rotation matrices [[cos, -sin], [sin, cos]]; a probe decides
    causal_arg: str | None = None  # a forward-level causal flag (CAUSAL_ARGS)
    mask_required: bool = False  # the mask is always passed, even beside a causal flag (then False): it has no default,
    # or the class does not honour its flag (a probe)
    cache_object: str | None = None  # the cache is an object passed in and advanced by the caller (plugins.cache_objects)
    lengths: tuple[str, ...] = ()  # forward-level context lengths (LENGTH_NAMES): the spec's
    unmasked: str | None = None  # an optional mask left at None: no form of it made the class causal, None did
    encoder: bool = False  # no form made it causal, and it is an encoder's attention (plugins.encoder)
    inputs: tuple[str, ...] = ()  # further required inputs: x again, for self-attention (plugins.causal_probe)
    probed: tuple[str, ...] = ()  # required arguments no name tells, their forms not yet decided (plugins.causal_probe)
    leaky: str = ""  # no form made it causal, but its forward says it is: why it is checked (plugins.causal_intent)
    cache_probed: bool = False  # the cache's name is none attnbench knows: a probe found it (plugins.cache_probe)
    keywords: bool = False  # the forward takes **kwargs: a mask no parameter names may reach an inner module through it
    buffers: str = ""  # the cache is the caller's preallocated (k, v) buffers, "bshd" or "bhsd" (a probe decides; gemma)
    helpers: tuple = ()  # (name, nn.Module class) of arguments that are modules of its own code (plugins.helper_args)

    @property
    def rope_style(self) -> str:
        """The RoPE pairing assumed before a probe measures it: ``interleaved`` for per-frequency tables, else ``half``."""
        return "interleaved" if any(self.per_frequency(n) for n in self.tables) else "half"

    @staticmethod
    def cis(name: str) -> bool:
        """Is the table ``name`` one of each frequency's rotation (complex, real or matrices: a probe decides), given
        to an argument no name tells (:data:`TABLE_NAMES`)?"""
        return name not in TABLE_NAMES

    @staticmethod
    def per_frequency(name: str) -> bool:
        """Does the table ``name`` hold each frequency once (a :meth:`cis` table, ``freqs_cos``/``freqs_sin``)?"""
        return name in ("freqs_cos", "freqs_sin") or ContextPlan.cis(name)

    def describe(self) -> list[str]:
        """What is bound, one line each, for ``check -v``."""
        lines = []
        if self.mask:
            form = self.mask_form.describe() if self.mask_form else "undecided"
            through = " through its **kwargs (no parameter of its forward names a mask)" if self.keywords else ""
            lines.append(f"bound {self.mask}{through}: the causal/windowed mask of each step, {form} (decided by a "
                         "probe: changing the last token changes only the last output)")
        for name, cls in self.helpers:
            lines.append(f"bound {name}: a {cls.__qualname__} (a module of its own code the forward takes) built for "
                         "each spec by its constructor's names")
        if self.inputs:
            lines.append(f"bound {', '.join(self.inputs)}: {self.x} again (self-attention: every input is the same "
                         "sequence; decided by the causal probe)")
        if self.tables:
            rows = "(context_length, head_dim) tables indexed by the class" if self.full_tables else \
                "the rows of the step's positions"
            form = {"complex": " complex", "real": " real (..., head_dim/2, 2) = (cos, sin)",
                    "matrix": " rotation matrices (..., head_dim/2, 2, 2) = [[cos, -sin], [sin, cos]]"}
            cis = next((n for n in self.tables if self.cis(n)), None)
            lines.append(f"bound {', '.join(self.tables)}: the spec's {self.rope_style} RoPE tables (neutral without "
                         f"RoPE), {rows}{', ' + cis + form[self.table_form] if cis else ''}"
                         f"{', shaped ' + TABLE_DIMS[self.table_dims] if self.table_dims else ''} "
                         "(forms decided by a probe)")
        if self.position:
            kind = POSITION_NAMES.get(self.position, "ids (T,), a position by its name's word (the causal probe ran the "
                                                     "class with it)")
            kind += ", a tensor (T_new,) while decoding into its own cache" if kind == "int" and self.cache_builder else ""
            none = "; None outside decoding (decided by a probe)" if self.position_none else ""
            lines.append(f"bound {self.position}: the absolute position of the step's first token ({kind}){none}")
        if self.attr_cache:
            lines.append(describe_attr_cache(self.attr_cache, self.cache_builder))
        if self.span_arg:
            lines.append(f"bound {self.span_arg}: the end of the cache's filled part while decoding, None otherwise")
        if self.nones:
            lines.append(f"bound {', '.join(self.nones)}: None (a required input the class runs causally without, by a "
                         "probe: an extra input its model mixes in, none here)")
        if self.falses:
            lines.append(f"bound {', '.join(self.falses)}: False (a required bool flag; attnbench calls the class plainly)")
        if self.seq_lengths:
            lines.append(f"bound {', '.join(self.seq_lengths)}: each sequence's length (B,), every token so far (no "
                         "padding; by a probe)")
        lines += self._unmasked_lines()
        if self.lengths:
            lines.append(f"bound {', '.join(self.lengths)}: the spec's context_length")
        if self.window_arg:
            lines.append(f"bound {self.window_arg}: the spec's window as (left, right): (window - 1, 0), (-1, 0) for none")
        if self.causal_arg:
            lines.append(f"bound {self.causal_arg}: the spec's causality when no mask is passed"
                         + (f" ({self.mask} is passed only for a window or a step after cached tokens, with "
                            f"{self.causal_arg}=False)"
                            if self.mask and not self.mask_required else f", False beside {self.mask}"
                            if self.mask else ""))
        lines += self._cache_lines()
        return lines


    def _cache_lines(self) -> list[str]:
        """How its cache parameter is given (buffers, an object, or what the previous step returned)."""
        lines = []
        if self.cache and self.buffers:
            layout = "(B, context_length, kv_heads, head_dim)" if self.buffers == "bshd" else \
                "(B, kv_heads, context_length, head_dim)"
            lines.append(f"bound {self.cache}: preallocated zero key and value buffers {layout}, the class writes each "
                         "step into them; fresh for each call outside decoding, kept across the steps while decoding "
                         f"(layout decided by a probe){'; ' + self.mask + ' covers every slot' if self.mask else ''}")
        elif self.cache and self.cache_object:
            made = "its attnbench_cache_object" if self.cache_object == "declared" else \
                cache_object_for(None, self.cache_object).words
            lines.append(f"bound {self.cache}: None outside decoding; while decoding one cache object made at the first "
                         f"step ({made}), advanced after each step unless the forward advanced it")
        elif self.cache:
            lines.append(f"bound {self.cache}: the cache the previous step returned beside its output (out, next_cache); "
                         "None at the first step, and always when what it returns are scores or probabilities"
                         + (" (found by a probe: passing back what a 3-token call returned makes the next token's output "
                            "that of a 4-token call)" if self.cache_probed else "")
                         + ("; use_cache=True while decoding" if self.use_cache else ""))
        return lines

    def _unmasked_lines(self) -> list[str]:
        """Why its mask is left at None, or why a class no form made causal is checked all the same."""
        if self.leaky:
            how = f"{self.unmasked} left at None (it makes its own mask)" if self.unmasked else \
                "the form under which later tokens move earlier outputs least"
            return [f"not causal with any mask form, but its forward says it is causal ({self.leaky}): checked with "
                    f"{how}; its causal cases fail and are localised"]
        if self.unmasked:
            return [f"left {self.unmasked} at None: no mask form made the class causal, and without one it is "
                    "(a padding mask, or a class that masks by itself): causal attention only"]
        return []


def plan_for(target) -> ContextPlan | None:
    """The context ``target.forward`` takes, or ``None`` when it takes nothing attnbench binds (``forward(x)``,
    ``forward(x, use_cache=False)``). Raises :class:`PluginLoadError` for a required
    parameter attnbench cannot supply."""
    forward = getattr(target, "forward", None) if inspect.isclass(target) else None
    if forward is None:
        return None
    try:
        params = list(signatures.signature(forward).parameters.values())[1:]  # self
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not named:
        return None
    x, rest = named[0].name, named[1:]
    helpers = tuple((p.name, cls) for p in rest if p.name not in KNOWN_NAMES and (cls := module_class(p, target)))
    rest = [p for p in rest if p.name not in dict(helpers)]
    names = [p.name for p in rest]
    unknown = [p for p in rest if p.default is p.empty and p.name not in KNOWN_NAMES]
    name = getattr(target, "__qualname__", repr(target))
    falses = tuple(p.name for p in unknown if _annotated(p, "bool"))
    typed = [p.name for p in unknown if plain_type(p) and p.name not in falses]
    unknown = [p for p in unknown if p.name not in falses]
    # a tensor defaulting to None that the class may not do without (LlamaGen's `freqs_cis: torch.Tensor = None`):
    # probed too, None first, so a class that runs without it is bound as before
    unknown += [p for p in rest if p.default is None and p.name not in KNOWN_NAMES and _tensor_type(p)]
    if typed:
        raise PluginLoadError(f"{name}.forward needs {', '.join(map(repr, typed))}, which attnbench cannot supply "
                              f"(it supplies by name: {SUPPLIED}); give {'them defaults' if len(typed) > 1 else 'it a default'}, "
                              f"rename, or wrap the class ({GUIDE})")
    tables = tuple(n for n in names if n in TABLE_NAMES)
    if ("freqs_cos" in tables) != ("freqs_sin" in tables):
        raise PluginLoadError(f"{name}.forward takes one of freqs_cos/freqs_sin without the other; attnbench supplies "
                              f"the pair ({GUIDE})")
    if ("cos" in tables) != ("sin" in tables):
        raise PluginLoadError(f"{name}.forward takes {'cos' if 'cos' in tables else 'sin'} without "
                              f"{'sin' if 'cos' in tables else 'cos'}; attnbench supplies the pair ({GUIDE})")
    position = next((n for n in names if n in POSITION_NAMES), None)
    cache = next((n for n in names if n in CACHE_NAMES), None)
    causal_arg = next((n for n in names if n in CAUSAL_ARGS), None)
    mask = next((n for n in names if n in MASK_NAMES), None)
    required = {p.name for p in rest if p.default is p.empty}
    if not (required or unknown or falses or tables or position or cache or causal_arg or mask or helpers or
            any(n in WINDOW_ARGS + LENGTH_NAMES for n in names)):
        return None  # e.g. forward(x, use_cache=False)
    # forward(x, attn_mask=None) too is planned: left at None when the class is causal without it, the causal form the
    # class reads when it is not (open_clip's Attention), refused as not causal when no form makes it so (dinov2's)
    return ContextPlan(name, x, mask=mask, tables=tables, position=position, cache=cache, use_cache="use_cache" in names,
                       probed=tuple(p.name for p in unknown), lengths=tuple(n for n in names if n in LENGTH_NAMES),
                       position_optional=any(p.name == position and p.default is None for p in rest),
                       cache_default=any(p.name == cache and p.default is not p.empty and p.default is not None
                                         for p in rest),
                       window_arg=next((n for n in names if n in WINDOW_ARGS), None), causal_arg=causal_arg,
                       span_arg=next((n for n in names if n in SPAN_ARGS), None), mask_required=mask in required,
                       keywords=mask is None and any(p.kind == p.VAR_KEYWORD for p in params), helpers=helpers,
                       falses=falses)


def _tensor_type(p: inspect.Parameter) -> bool:
    """Is ``p`` annotated as a tensor (``torch.Tensor``, ``Optional[Tensor]``, ``Tensor | None``)?"""
    ann = p.annotation
    return "Tensor" in (ann if isinstance(ann, str) else repr(ann) if ann is not p.empty else "")


def plain_type(p: inspect.Parameter) -> bool:
    """Is ``p`` annotated ``int``, ``float``, ``bool`` or ``str``: no tensor a probe could give it?"""
    return _annotated(p, "int", "float", "bool", "str")


def _annotated(p: inspect.Parameter, *types: str) -> bool:
    ann = p.annotation
    return (ann if isinstance(ann, str) else getattr(ann, "__name__", "")) in types


def step_mask(spec: AttnSpec, start: int, length: int, device=None) -> torch.Tensor:
    """``(length, start + length)`` bool, True = hidden: query ``start + i`` hides key ``j`` when ``j`` is later
    (causal) or outside the window (``|i - j| >= window``)."""
    q = torch.arange(start, start + length, device=device)[:, None]
    k = torch.arange(start + length, device=device)[None, :]
    hidden = (k > q) if spec.causal else torch.zeros(length, start + length, dtype=torch.bool, device=device)
    if spec.window is not None:
        hidden = hidden | ((q - k).abs() >= spec.window)
    return hidden


def rope_rows(spec: AttnSpec, positions: torch.Tensor, style: str, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's ``(cos, sin)`` rows at ``positions``, each ``(len(positions), head_dim)``; neutral (1, 0) when the
    spec has no RoPE."""
    theta = getattr(spec, "rope_theta", None)
    if theta is None:
        shape = (len(positions), spec.head_dim)
        return torch.ones(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    from attnbench.correctness.rope import rope_tables

    cos, sin = rope_tables(positions.cpu(), spec.head_dim, theta, getattr(spec, "rope_scaling", None), style=style,
                           dtype=torch.float64)
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def arguments(plan: ContextPlan, spec: AttnSpec, x: torch.Tensor, start: int, cache, decoding: bool) -> dict:
    """The keyword arguments of one call: ``x`` holds tokens ``start .. start + T - 1``; the keys are those of the
    cache (positions from 0) and ``x`` when decoding, else those of ``x`` alone."""
    T, device, dtype = x.shape[1], x.device, x.dtype if x.is_floating_point() else torch.float32
    kwargs: dict = {}
    cached = decoding and start > 0  # keys before the queries: a causal flag (SDPA's, top-left) would hide them
    masked = plan.mask and (plan.mask_required or not plan.causal_arg or spec.window is not None or cached)
    if plan.causal_arg:  # a flag beside a mask would mask twice (SDPA refuses both): the mask alone says it then
        kwargs[plan.causal_arg] = bool(spec.causal and not masked and not cached)
    if masked:
        form = plan.mask_form or MASK_FORMS[0]
        hidden = step_mask(spec, start, T, device) if not plan.buffers else buffer_mask(spec, start, T, decoding, device)
        kwargs[plan.mask] = form.make(hidden if decoding or plan.buffers else hidden[:, start:], dtype, x.shape[0])
    if plan.tables:
        rows = torch.arange(spec.context_length if plan.full_tables else T, device=device)
        cos, sin = rope_rows(spec, rows if plan.full_tables else rows + start, "half", dtype, device)
        for name in plan.tables:
            if name in ("freqs_cos", "freqs_sin"):  # llama2.c: (T, head_dim // 2), each frequency once
                once = (cos if name == "freqs_cos" else sin)[:, : cos.shape[-1] // 2]
                kwargs[name] = once.repeat_interleave(2, dim=-1) if plan.table_dims == "wide" else once
            elif plan.cis(name):  # Meta: complex (T, head_dim // 2), the pair frequencies once each
                half = cos.shape[-1] // 2
                kwargs[name] = _cis(cos[:, :half], sin[:, :half], plan.table_form)
            elif name in PAIR_NAMES:
                kwargs[name] = (_shaped(cos, plan.table_dims or "3d"), _shaped(sin, plan.table_dims or "3d"))
            else:
                kwargs[name] = _shaped(cos if name == "cos" else sin, plan.table_dims)
    if plan.position and plan.position_none and not decoding:
        kwargs[plan.position] = None
    elif plan.position:
        kind = POSITION_NAMES.get(plan.position, "ids (T,)")
        ids = torch.arange(start, start + T, device=device)
        if kind == "int" and decoding and plan.cache_builder:  # its own preallocated cache is written at positions
            kind = "ids (T,)"
        kwargs[plan.position] = start if kind == "int" else ids[None] if kind.startswith("ids (1") else ids
    if plan.span_arg:
        kwargs[plan.span_arg] = start + T if decoding else None
    kwargs.update({name: build_helper(cls, spec, device) for name, cls in plan.helpers})
    kwargs.update(dict.fromkeys(plan.inputs, x))
    kwargs.update(dict.fromkeys(plan.nones))
    kwargs.update(dict.fromkeys(plan.falses, False))
    total = start + T if decoding else T
    kwargs.update({n: torch.full((x.shape[0],), total, dtype=torch.long, device=device) for n in plan.seq_lengths})
    kwargs.update(dict.fromkeys(plan.lengths, spec.context_length))
    if plan.window_arg:
        left = -1 if spec.window is None else spec.window - 1
        kwargs[plan.window_arg] = (left, 0 if spec.causal else left)
    if plan.buffers:  # written in place: the step's own while decoding (kept by bind_context), else fresh ones
        kwargs[plan.cache] = cache if cache is not None else make_buffers(plan, spec, x)
    elif plan.cache and not (cache is None and plan.cache_default):  # CosyVoice's cache=torch.zeros((0, 0, 0, 0))
        kwargs[plan.cache] = cache
    if plan.use_cache:
        kwargs["use_cache"] = decoding
    return kwargs


def buffer_mask(spec: AttnSpec, start: int, length: int, decoding: bool, device=None) -> torch.Tensor:
    """``(length, context_length)`` bool, True = hidden, over a preallocated cache's every slot (gemma's mask): a
    query hides the slots after it (the unwritten ones too), outside its window, and, outside decoding (fresh
    buffers), the slots before ``start``; without causality only the unwritten slots."""
    hidden = torch.nn.functional.pad(step_mask(spec, start, length, device), (0, spec.context_length - start - length),
                                     value=True)
    if not decoding:
        hidden[:, :start] = True
    return hidden


def make_buffers(plan: ContextPlan, spec: AttnSpec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed key and value buffers of ``context_length`` slots in ``plan.buffers``' layout, for ``x``'s batch."""
    slots, heads = spec.context_length, spec.kv_heads
    shape = (x.shape[0], slots, heads, spec.head_dim) if plan.buffers == "bshd" else \
        (x.shape[0], heads, slots, spec.head_dim)
    return tuple(torch.zeros(shape, dtype=x.dtype, device=x.device) for _ in range(2))


def _cis(c: torch.Tensor, s: torch.Tensor, form: str) -> torch.Tensor:
    """Each frequency's rotation in ``form`` (:attr:`ContextPlan.table_form`) from its ``(T, head_dim // 2)`` cos and sin."""
    if form == "real":
        return torch.stack([c, s], -1)
    if form == "matrix":
        return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    return torch.complex(c.float(), s.float())


def _shaped(table: torch.Tensor, dims: str) -> torch.Tensor:
    """A ``(T, head_dim)`` half-style table in the shape ``dims`` (:data:`TABLE_DIMS`)."""
    if dims == "seq_half":
        return table[:, : table.shape[-1] // 2][None, :, None]
    return table[None] if dims == "3d" else table[None, None] if dims == "4d" else table  # "" and "2d": (T, head_dim)


def _split(result, plan: ContextPlan, t_new: int, total: int | None = None, head_dim: int | None = None,
           x: torch.Tensor | None = None):
    """``(out, next_cache)`` of a call of ``t_new`` tokens, ``total`` with those before it (``next_cache`` None when the
    class returns no cache: Hugging Face layers return ``(out, attention weights)``, their cache an object passed in;
    Whisper returns ``(out, qk)``, its scores, its cache filled by hooks of the whole model)."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):  # rafidka's MultiHeadAttentionOutput(
        result = tuple(getattr(result, f.name) for f in dataclasses.fields(result))  # output, kv_cache): in order
    if isinstance(result, tuple | list) and result and isinstance(result[0], torch.Tensor):
        result = output_first(None, (x,), {}, result) if x is not None else result  # TimesFM's (scores, output)
        rest = [r for r in result[1:] if r is not None and not _weights(r, t_new)  # 4.x-era Hugging Face:
                and not _scores(r, t_new, total, head_dim)] if plan.cache else []  # (out, None or weights, past)
        return result[0], rest[0] if rest else None
    return result, None


def _scores(t, t_new: int, total: int | None, head_dim: int | None) -> bool:
    """Whether ``t`` is attention scores of ``t_new`` queries over ``total`` keys, ``(..., t_new, total)``; a cache
    holds ``(..., total, head_dim)``, so a step whose ``total`` is the head dim cannot tell (a cache then)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 3 and total is not None
            and tuple(t.shape[-2:]) == (t_new, total) and total != head_dim)


def _weights(t, t_new: int) -> bool:
    """Whether ``t`` is attention probabilities of ``t_new`` queries: ``(..., t_new, S)``, rows that sum to 1."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 3 or t.shape[-2] != t_new:
        return False
    rows = t.detach().float()
    return bool((rows >= 0).all() and torch.allclose(rows.sum(-1), torch.ones(()), atol=1e-2))


def bind_context(module: nn.Module, plan: ContextPlan, spec: AttnSpec) -> nn.Module:
    """``module`` rebound to ``forward(x, use_cache=False, start_pos=0)`` (``start_pos``: where a prefill without the
    cache starts) and ``reset_cache()``, its context supplied by ``plan`` for ``spec``: its class is replaced by a subclass made for it (as
    ``torch.nn.utils.parametrize`` does), so parameter names, hooks and ``.to()`` are unchanged."""
    base = type(module)
    original = base.forward
    maker = cache_object_for(base, plan.cache_object)
    own_reset = next((getattr(base, n) for n in ("reset_cache", "reset_kv_cache", "clear_cache")
                      if callable(getattr(base, n, None))), None)

    def forward(self, x, use_cache: bool = False, start_pos: int = 0):
        start = self._attnbench_pos if use_cache else start_pos
        if use_cache and plan.buffers and self._attnbench_cache is None:  # made at the first step, kept until reset
            self._attnbench_cache = make_buffers(plan, spec, x)
        cache = self._attnbench_cache if use_cache else None
        if maker is not None:
            return _object_step(self, original, maker, plan, spec, x, start, use_cache)
        if plan.attr_cache:  # installed while decoding (kept across steps), None otherwise (as built)
            if use_cache and not self._attnbench_installed:
                setattr(self, plan.attr_cache, AppendingCache() if not plan.cache_builder else
                        build_own_cache(self, plan.cache_builder, x.shape[0], spec.context_length, x.device, x.dtype))
                self._attnbench_installed = True
            if not use_cache:
                setattr(self, plan.attr_cache, None)
                self._attnbench_installed = False
        out, next_cache = _split(original(self, x, **arguments(plan, spec, x, start, cache, use_cache)), plan, x.shape[1],
                                 start + x.shape[1], spec.head_dim, x)
        if use_cache:
            self._attnbench_pos = start + x.shape[1]
            self._attnbench_cache = cache if plan.buffers else next_cache
        return out

    def reset_cache(self) -> None:
        if own_reset is not None:
            own_reset(self)
        self._attnbench_pos, self._attnbench_cache = 0, None
        if plan.attr_cache:
            setattr(self, plan.attr_cache, None)
            self._attnbench_installed = False

    members = {"forward": forward, "reset_cache": reset_cache, "attnbench_context": plan,
               "__doc__": base.__doc__, "__module__": base.__module__}
    module.__class__ = type(base.__name__, (base,), members)
    module._attnbench_pos, module._attnbench_cache, module._attnbench_installed = 0, None, False
    return module


def _object_step(module: nn.Module, original, maker, plan: ContextPlan, spec: AttnSpec, x, start: int,
                 use_cache: bool):
    """One call of a forward that takes a cache object (:mod:`~attnbench.plugins.cache_objects`): None outside
    decoding; while decoding the module's object (made at the first step), advanced as the model would."""
    cache = None
    if use_cache:
        if module._attnbench_cache is None:
            module._attnbench_cache = maker.make(spec, x.shape[0], x.device, x.dtype)
        cache = module._attnbench_cache
        if isinstance(cache, LayerCache):
            cache.tokens = x.shape[1]  # tells its sequence axis from its heads'
    kwargs = arguments(plan, spec, x, start, cache, use_cache)
    result = maker.step(cache, lambda: original(module, x, **kwargs), x.shape[1]) if use_cache else \
        original(module, x, **kwargs)
    if use_cache:
        module._attnbench_pos = start + x.shape[1]
    return _split(result, replace(plan, cache=None), x.shape[1], x=x)[0]

