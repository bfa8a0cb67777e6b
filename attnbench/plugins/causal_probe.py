"""The forms of what a forward takes, decided by one probe: the first under which the class's outputs are causal.

A :class:`~attnbench.plugins.context.ContextPlan` says what ``forward`` takes; how each piece is given is decided here,
on the class itself, never against the reference: with the right forms, changing the last of 5 tokens changes only the
last output. Tried in turn: the mask's form (:data:`~attnbench.plugins.context.MASK_FORMS`), the rotary tables' form and
shape, a position that defaults to None, and the **arguments no name tells** (issue 46): each required one is given, in
this order, ``None`` (an input the class can do without: nanochat's value embeddings, torchtitan's ``attention_masks``),
``x`` again (``forward(q, k, v, mask)``: self-attention passes one sequence for each), the step's position ids
(gemma's ``kv_write_indices``) or rotary tables in each form attnbench builds (flux's ``pe``: rotation matrices
``(..., head_dim/2, 2, 2)``). A class none of them makes causal is refused with the first true cause: not causal with
any form (it ran, but every token saw later ones), cross-attention over an input of its own width (given ``x`` it
raised on a projection of another width), or an argument nothing fits (it raised with each).
"""

from __future__ import annotations

import itertools
import re
import traceback
import warnings
from dataclasses import replace

import torch
from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.plugins.context import (
    GUIDE,
    MASK_FORMS,
    MASK_NAMES,
    PADDING,
    PAIR_NAMES,
    SUPPLIED,
    TABLE_DIMS,
    ContextPlan,
    MaskForm,
    arguments,
    bind_context,
)
from attnbench.spec import AttnSpec

ARG_FORMS = {"none": "None", "x": "x again", "ids": "the step's position ids (T,)", "table": "rotary tables",
             "lengths": "each sequence's length (B,)", "mask": "the causal mask"}
"""How a required argument no name tells may be given, in the order tried (:func:`_given`)."""
MAX_VARIANTS = 64
"""At most this many assignments of :data:`ARG_FORMS` to such arguments are tried (the plainest first)."""
MAX_COMBOS = 4096
"""At most this many assignments are ordered (six arguments' every assignment)."""


def _built(build, plan: ContextPlan, spec: AttnSpec):
    """(the module built at ``spec`` with ``plan``'s context, the spec it was built at): without a theta first,
    then, when that raises, with one (a class that always rotates by a theta it is given: ``rope_base ** ...``
    raises on ``None``; a rotation leaves causality as it is)."""
    try:
        return bind_context(build(spec).eval(), plan, spec), spec
    except Exception as first:
        if spec.rope_theta is not None:
            raise
        spec = replace(spec, rope_theta=10000.0)
        try:
            return bind_context(build(spec).eval(), plan, spec), spec
        except Exception:
            raise first from None  # it fails with a theta too: what it raised as given is the cause


def _moves(build, plan: ContextPlan, spec: AttnSpec, form: MaskForm | None, full: bool) -> bool | str:
    """Causal on a probe? ``True`` when changing the last of 5 tokens changes only the last output; ``False`` when the
    class runs but is not; the exception, in words, when the call raises."""
    plan = replace(plan, mask_form=form, full_tables=full)
    if plan.table_form in ("real", "matrix"):  # not told from a complex table by a neutral one: a real rotation
        spec = replace(spec, rope_theta=10000.0)
    try:
        module, spec = _built(build, plan, spec)
    except Exception as exc:
        return f"does not build at the probe's sizes ({type(exc).__name__}: {exc})"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, spec.d_in, generator=g)  # two rows: a mask form that only works at batch 1 is not bound
    y = x.clone()
    y[:, -1] += torch.randn(spec.d_in, generator=g)
    try:  # a wrong form may run with a warning (a complex table cast to real): the probe's, not the user's
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b = module(x), module(y)
    except Exception as exc:
        return _raised(exc, build)
    if not isinstance(a, torch.Tensor) or a.shape[:2] != (2, 5) or not torch.isfinite(a).all():
        return False
    diff = (a - b).abs().amax(dim=(0, 2))
    scale = a.abs().max().clamp_min(1e-6)
    return bool((diff[:-1] <= 1e-5 * scale).all() and diff[-1] > 1e-3 * scale)


def _raised(exc: Exception, build) -> str:
    """What a probe call raised, with the line of the class's own forward it raised at (how far the call got)."""
    code = getattr(getattr(getattr(build, "target", None), "forward", None), "__code__", None)
    line = max((n for frame, n in traceback.walk_tb(exc.__traceback__) if frame.f_code is code), default=0)
    text = f"raises {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"{text} (forward line {line})" if line else text


def forward_is_causal(build, spec: AttnSpec) -> bool:
    """Does the ``forward(x)`` class ``build`` makes give causal outputs at ``spec``? False when it raises."""
    return _moves(build, ContextPlan("forward(x)", "x"), spec, None, False) is True


def _masking(plan: ContextPlan) -> ContextPlan:
    """``plan`` as it calls a class that has both a mask and a causal flag when the mask says it all (a window): the
    mask passed and the flag False (not the class's default, which may be True: SDPA refuses both), so that the probe
    decides the mask's form."""
    return replace(plan, mask_required=True) if plan.causal_arg and plan.mask else plan


def _with_flag(build, plan: ContextPlan, probe: AttnSpec) -> ContextPlan:
    """``plan`` as it is when the flag alone (no mask) makes the class causal; else one that always passes the mask
    (with the flag False): a class that does not honour its flag."""
    if not (plan.causal_arg and plan.mask) or plan.mask_required:
        return plan
    if _moves(build, plan, probe, plan.mask_form, plan.full_tables) is True:
        return plan
    return replace(plan, mask_required=True)


def _shapes(plan: ContextPlan) -> list[tuple]:
    """The (table form, table shape[, position None]) choices to try for ``plan``'s tables, the default first."""
    shapes = [("complex", "")]
    shapes += [("real", ""), ("matrix", "")] if any(plan.cis(n) for n in plan.tables) else []
    shapes += [("complex", d) for d in TABLE_DIMS if d and d != "wide"] if {"cos", *PAIR_NAMES} & set(plan.tables) \
        else []
    shapes += [("complex", "wide")] if "freqs_cos" in plan.tables else []
    return shapes + ([(p, d, True) for p, d in shapes] if plan.position_optional else [])


def _first_causal(build, plan: ContextPlan, probe: AttnSpec) -> tuple[ContextPlan | None, list[str], bool]:
    """The first choice of forms under which the class is causal (None when none is), what each try gave in words,
    and whether the class ran under any of them."""
    tried, ran, flat = [], False, None
    for chosen in _choices(plan):
        form, full = chosen.mask_form, chosen.full_tables
        verdict = _moves(build, _masking(chosen), probe, form, full)
        if verdict is True and form is not None and not _scores_matter(build, _masking(chosen), probe):
            flat = flat or chosen  # causal, but the scores drowned (BERT's (1 - mask) * min given -inf)
        elif verdict is True:
            return _with_flag(build, chosen, probe), tried, True
        ran = ran or verdict is False
        tables = [f"{t} as {_TABLE_WORDS[chosen.table_form]}" for t in plan.tables if plan.cis(t)]
        tried.append(f"{', '.join([*tables, form.describe() if form else 'no mask'])}: {verdict or 'not causal'}")
    return (None, tried, ran) if flat is None else (_with_flag(build, flat, probe), tried, True)


def _choices(plan: ContextPlan):
    """Each choice of table form, table shape, position None or not, full tables or not, and mask form for ``plan``,
    the default first."""
    for pairs, dims, *none in _shapes(plan):
        plan = replace(plan, position_none=bool(none))
        for full in (True, False) if plan.position and plan.tables else (False,):
            for form in (_mask_forms(plan) if plan.mask else (None,)):
                yield replace(plan, mask_form=form, full_tables=full, table_form=pairs, table_dims=dims)


def _mask_forms(plan: ContextPlan) -> tuple:
    """The mask forms to try: a ``(B, T)`` padding mask hiding nothing only for a mask the forward requires by a mask's
    name (an optional one is left at None when the class masks the future by itself)."""
    named = plan.mask_required and plan.mask in MASK_NAMES  # a required input of another name may be tables (flux's pe)
    return MASK_FORMS if named else tuple(f for f in MASK_FORMS if f.dims != PADDING)


def _scores_matter(build, plan: ContextPlan, spec: AttnSpec) -> bool:
    """Do the scores move the output under ``plan``'s mask form? Not when the output is linear in ``x`` (doubling
    ``x`` doubles what ``x`` adds to it): every visible position weighted alike, as a keep-mask's ``(1 - mask) * min``
    made of an additive ``-inf`` mask does. A form under which they do is preferred; True when a probe cannot tell."""
    try:
        module = bind_context(build(spec).eval(), plan, spec)
        x = torch.randn(2, 5, spec.d_in, generator=torch.Generator().manual_seed(3))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b, c = (module(t) for t in (x, 2 * x, torch.zeros_like(x)))
    except Exception:  # noqa: BLE001 - cannot tell: the form stands
        return True
    a, b, c = (t[0] if isinstance(t, tuple | list) else t for t in (a, b, c))
    if not all(isinstance(t, torch.Tensor) and bool(t.isfinite().all()) for t in (a, b, c)):
        return True
    return bool((b - 2 * a + c).abs().max() > 1e-4 * (a - c).abs().max().clamp_min(1e-6))


_TABLE_WORDS = {"complex": "complex tables", "real": "real (..., 2) tables", "matrix": "rotation matrices"}


def _given(plan: ContextPlan, name: str, how: str) -> ContextPlan:
    """``plan`` with the argument ``name`` given as ``how`` (:data:`ARG_FORMS`)."""
    if how == "none":
        return replace(plan, nones=(*plan.nones, name))
    if how == "x":
        return replace(plan, inputs=(*plan.inputs, name))
    if how == "ids":
        return replace(plan, position=name)
    if how == "lengths":
        return replace(plan, seq_lengths=(*plan.seq_lengths, name))
    if how == "mask":
        return replace(plan, mask=name, mask_required=True)
    return replace(plan, tables=(*plan.tables, name))


def _variants(plan: ContextPlan) -> list[tuple[ContextPlan, str]]:
    """``plan`` with each assignment of :data:`ARG_FORMS` to its arguments no name tells (``plan`` alone when it has
    none), and the assignment in words."""
    forms = [[f for f in ARG_FORMS if (f != "ids" or plan.position is None) and (f != "lengths" or "len" in name.lower())
              and (f != "mask" or plan.mask is None)]  # a mask under a name of its own (THUMT's bias): its forms probed
             for name in plan.probed]  # lengths only for a name that says so (seq_lens, key_value_sequence_lengths)
    combos = [c for c in itertools.islice(itertools.product(*forms), MAX_COMBOS)
              if list(c).count("ids") <= 1 and list(c).count("mask") <= 1]
    # the plainest first (None or x for every argument: fairseq's key, value, key_padding_mask, incremental_state),
    # so that four arguments' plain assignments are all tried within MAX_VARIANTS
    combos.sort(key=lambda c: sum(f not in ("none", "x") for f in c))
    out = []
    for combo in combos[:MAX_VARIANTS]:
        variant = replace(plan, probed=())
        for name, how in zip(plan.probed, combo, strict=True):
            variant = _given(variant, name, how)
        out.append((variant, ", ".join(f"{n} given {ARG_FORMS[h]}" for n, h in zip(plan.probed, combo, strict=True))))
    # an optional mask no form of which is causal, left at None, when the class is causal without it (minimind's
    # attention_mask is a (B, T) padding mask); tried after every form of it
    return out + [(replace(v, mask=None, unmasked=v.mask), w) for v, w in out if v.mask and not v.mask_required]


QUERY_NAMES = frozenset({"q", "query", "queries", "qx", "xq", "query_states"})
"""Inputs named as queries: each output reads its own position's query only, as an elementwise factor (a temperature)
would, so the test that an input is a sequence the class attends over does not apply to them (TencentPretrain's
``forward(key, value, query, mask)``); the causal probe still decides."""


def probe_mask(build, plan: ContextPlan, probe: AttnSpec) -> ContextPlan:
    """``plan`` with its forms decided on ``probe`` (causal, no RoPE): the first choice under which the class's outputs
    are causal (the class is compared with itself, never with the reference). Raises :class:`PluginLoadError` with the
    first true cause when none is."""
    probe = replace(probe, window=None, causal=True, context_length=max(probe.context_length, 9))
    outcomes = []
    for variant, words in _variants(plan):
        chosen, tried, ran = _first_causal(build, variant, probe)
        local = next((n for n in chosen.inputs if n.lower() not in QUERY_NAMES
                      and not _attends_over(build, chosen, probe, n)), None) if chosen else None
        if chosen is not None and local is None:
            return chosen
        if local is not None:  # forward(x, temperature): x / temperature is causal too, but no input
            tried = [f"{local} given x: each output reads {local} at its own position only, not a sequence it attends "
                     "over", *tried]
        outcomes.append((variant, words, tried, ran and local is None))
    found = _through_keywords(build, plan, probe) or _with_buffers(build, plan, probe) or _encoder(build, outcomes, probe)
    if found is not None:
        return found
    raise _refusal(build, plan, probe, outcomes)


def _encoder(build, outcomes: list, probe: AttnSpec) -> ContextPlan | None:
    """The first way of giving its arguments, with no mask, under which the class ran and is an encoder's attention
    (:mod:`~attnbench.plugins.encoder`: a BERT-style padding mask left at None, rtdl's ``x_kv`` given ``x``); None
    otherwise."""
    from attnbench.plugins.encoder import is_encoder, sized

    if not isinstance(getattr(build, "fields", None), set):  # not a Binding: nothing to read its sizes from
        return None
    length = sized(build)
    for variant, _, _, ran in outcomes:
        if ran and variant.mask is None and is_encoder(build, probe, lambda m, v=variant: bind_context(m, v, probe),
                                                       length):
            return replace(variant, encoder=True)
    return None


def _with_buffers(build, plan: ContextPlan, probe: AttnSpec) -> ContextPlan | None:
    """A forward that takes a cache, causal with no form while given none: the first layout of preallocated ``(k,
    v)`` buffers (``(B, S, H, D)``, then ``(B, H, S, D)``) under which it is, its mask over every slot (gemma's
    ``kv_cache`` tuple, written with ``index_copy_`` at ``kv_write_indices``); None when none is."""
    if plan.cache is None or plan.cache_object or plan.buffers:
        return None
    return _first_of(build, [replace(plan, buffers=layout) for layout in ("bshd", "bhsd")], probe, runs_first=True)


def _first_of(build, plans: list[ContextPlan], probe: AttnSpec, runs_first: bool = False) -> ContextPlan | None:
    """The first assignment of ``plans`` (each with its arguments no name tells assigned in turn) and its forms under
    which the class is causal; ``runs_first``: only assignments under which it runs at all go on to the mask forms."""
    for plan in plans:
        for variant, _ in _variants(plan):
            if runs_first and not _runs(build, variant, probe):
                continue  # raises however its tables are shaped: no mask form will change that (and it is quick)
            chosen, _, _ = _first_causal(build, variant, probe)
            if chosen is not None:
                return chosen
    return None


def _runs(build, plan: ContextPlan, probe: AttnSpec) -> bool:
    """Does the class run under ``plan`` (its first mask form) with its tables in some shape?"""
    for pairs, dims, *none in _shapes(plan):
        shaped = replace(plan, table_form=pairs, table_dims=dims, position_none=bool(none))
        if isinstance(_moves(build, _masking(shaped), probe, MASK_FORMS[0] if plan.mask else None, False), bool):
            return True
    return False


def _through_keywords(build, plan: ContextPlan, probe: AttnSpec) -> ContextPlan | None:
    """A forward that takes ``**kwargs`` and names no mask, causal with none of its forms: the first mask name (of
    :data:`~attnbench.plugins.context.MASK_NAMES`) and form under which it is, passed through its ``**kwargs`` to the
    inner module that reads it (torchmultimodal's ``MultiHeadAttention(..., **attn_kwargs)`` hands
    ``attention_mask`` to its ``SelfAttention``); None when none is, and the refusal stands."""
    if not plan.keywords or plan.mask is not None:
        return None
    return _first_of(build, [replace(plan, mask=name, mask_required=True) for name in MASK_NAMES], probe)


def checked_anyway(build, plan: ContextPlan, probe: AttnSpec) -> ContextPlan | None:
    """A plan for a class no form (and no constructor flag) made causal although its forward says it is
    (:mod:`~attnbench.plugins.causal_intent`): an optional mask left at None (the class then makes its own), else the
    form that leaks least, of the first assignment of its arguments under which it runs; None otherwise (the refusal
    stands). Never for cross-attention."""
    from attnbench.plugins.causal_intent import intent, least_leaking

    said = intent(getattr(build, "target", None))
    if not said or any(f == "d_context" for _, f in getattr(build, "params", ())):
        return None
    probe = replace(probe, window=None, causal=True, context_length=max(probe.context_length, 9))
    variants = [v for v, _ in _variants(plan)]
    for variant in sorted(variants, key=lambda v: not (v.mask is None and v.unmasked)):  # its own mask first
        if variant.mask is None and variant.unmasked:  # an optional mask left at None: the class's own (causal) mask
            forms = [variant]
        else:
            forms = [_masking(chosen) for chosen in _choices(variant)]
        found = least_leaking(build, forms, probe, bind_context, said)
        if found is not None:
            return found
    return None


def _attends_over(build, plan: ContextPlan, probe: AttnSpec, name: str) -> bool:
    """Is ``name`` (given ``x``) a sequence the class attends over? Changing it at the first position alone moves the
    outputs at later positions, as keys or values do; an elementwise factor (a temperature) moves only the first. One
    that moves nothing is read as a sequence too: a planted ``probs @ k`` leaves the values unused (joeynmt's
    ``forward(k, v, q, mask)``), and the cases, not the binding, should say so."""
    spec = replace(probe, rope_theta=10000.0) if plan.table_form in ("real", "matrix") else probe
    try:
        module = build(spec).eval()
        x = torch.randn(1, 5, spec.d_in, generator=torch.Generator().manual_seed(1))
        kwargs = arguments(plan, spec, x, 0, None, False)
        other = x.clone()
        other[:, 0] += 1.0
        with torch.no_grad():
            a, b = (module(x, **{**kwargs, name: t}) for t in (x, other))
    except Exception:  # the causal probe ran it: what it raises here, the cases show
        return True
    a, b = (t[0] if isinstance(t, tuple | list) else t for t in (a, b))
    moved = (a - b).abs() > 1e-6 * a.abs().max()
    return bool(moved[:, 1:].any() or not moved.any())  # moving nothing: an input a bug leaves unused (k used as v)


def _refusal(build, plan: ContextPlan, probe: AttnSpec, outcomes: list) -> PluginLoadError:
    """Why no form made the class causal: it ran but saw later tokens (not causal, as cross-attention when a
    constructor parameter is its context's width), a second input has a width of its own, or nothing fits."""
    ran = [(v, words, tried) for v, words, tried, did in outcomes if did]
    variant, words, _ = (ran or [(o[0], o[1], o[2]) for o in outcomes])[0]
    tried = sorted(dict.fromkeys(t for *_, seen, _ in outcomes for t in seen),
                   key=lambda t: ": raises " in t or ": does not build" in t)  # what ran first
    cross = [p for p, f in getattr(build, "params", ()) if f == "d_context"]
    inputs = f" with {', '.join(variant.inputs)} given {plan.x} (self-attention)" if variant.inputs else ""
    if ran and cross:
        return PluginLoadError(f"{plan.target} is cross-attention ({cross[0]} is the width of its second input, given "
                               f"d_in){inputs}: it is not causal with any mask form attnbench can supply",
                               details=[f"tried {'; '.join(tried[:4])}"],
                               fix=f"check a causal self-attention class ({GUIDE})")
    errors = {t[t.index(": raises ") + 2:] for *_, seen, _ in outcomes for t in seen if ": raises " in t}
    if not ran and len(errors) == 1 and outcomes:  # the same error however its arguments are given: not theirs
        return _raises_anyway(build, plan, probe, outcomes[0][0], errors.pop(), tried)
    if ran or not plan.probed:
        given = f" ({words})" if words else ""
        return PluginLoadError(f"{plan.target}.forward is not causal with any mask form attnbench can supply{inputs}"
                               f"{given} ({'; '.join(tried[:6])}); check what {plan.mask or plan.x} expects ({GUIDE})")
    return _cannot_supply(build, plan, probe, outcomes)


def _raises_anyway(build, plan: ContextPlan, probe: AttnSpec, variant: ContextPlan, error: str,
                   tried: list[str]) -> PluginLoadError:
    """Every way of giving its mask raised the same ``error``: that error is the first cause, not causality. A
    projection that receives ``x`` at a width not its own is named (EAGLE's draft ``LlamaAttention``: its projections
    take two hidden states joined, ``2 * hidden_size`` features)."""
    given = plan.mask or ", ".join(plan.probed) or "its arguments"
    width = other_width(build, variant, probe)
    if width is not None and not variant.inputs:
        name, features = width
        return PluginLoadError(f"{plan.target}'s {name} takes {features} features, but its input {plan.x} has the "
                               f"width its constructor was given ({probe.d_in}): its forward {error}, however "
                               f"attnbench gives {given}",
                               details=[f"tried {'; '.join(tried[:3])}"],
                               fix="an input wider than the model width by design (EAGLE's draft layer joins two "
                                   "hidden states) is not one attnbench's cases give: wrap the class so that it takes "
                                   f"x of its model width, with a weight_adapter for the wider projections ({GUIDE})")
    return PluginLoadError(f"{plan.target}.forward {error}, however attnbench gives {given}",
                           details=[f"tried {'; '.join(tried[:3])}"],
                           fix=f"check what its forward needs there, or `attnbench adapt FILE:Class` writes an adapter "
                               f"({GUIDE})")


def _cannot_supply(build, plan: ContextPlan, probe: AttnSpec, outcomes: list) -> PluginLoadError:
    """The refusal of a class that raised under every way of giving its arguments no name tells: cross-attention when,
    given ``x``, a projection of another width raised; else what each way raised."""
    as_x = next((v for v, *_ in outcomes if v.inputs), None)
    width = other_width(build, as_x, probe) if as_x is not None else None
    if width is not None:
        name, features = width
        return PluginLoadError(f"{plan.target} is cross-attention: {', '.join(as_x.inputs)} has a width of its own "
                               f"({name} takes {features} features, {plan.x} has {probe.d_in}), so it cannot be "
                               f"{plan.x}: not a self-attention layer",
                               fix="if a constructor parameter sets that width, give it the width of x (`attnbench adapt "
                                   "FILE:Class` writes an adapter), or check a self-attention class")
    seen = "; ".join(f"{words}: {tried[0] if tried else 'nothing tried'}" for _, words, tried, _ in outcomes[:4])
    names = ", ".join(map(repr, plan.probed))
    raised = [(words, next((t for t in tried if ": raises " in t), "")) for _, words, tried, _ in outcomes]
    lines = [int(m.group(1)) if (m := re.search(r"\(forward line (\d+)\)$", t)) else 0 for _, t in raised]
    if max(lines) > min(lines):  # given one way, it got past where the others raised: what stops it is further on
        words, entry = raised[lines.index(max(lines))]
        return PluginLoadError(f"{plan.target}.forward raises however attnbench gives {names}: furthest with {words}, "
                               f"it {entry[entry.index(': raises ') + 2:]}", details=[seen[:400]],
                               fix=f"check what its forward needs there, or `attnbench adapt FILE:Class` writes an "
                                   f"adapter with a TODO for what attnbench cannot supply ({GUIDE})")
    return PluginLoadError(f"{plan.target}.forward needs {names}, which attnbench cannot supply: given None, x again, "
                           "position ids or rotary tables, it ran as causal attention with none of them",
                           details=[seen[:400], f"it supplies by name: {SUPPLIED}"],
                           fix=f"give it a default, or `attnbench adapt FILE:Class` writes an adapter with a TODO for it "
                               f"({GUIDE})")


def other_width(build, plan: ContextPlan, probe: AttnSpec) -> tuple[str, int] | None:
    """``(linear, in_features)`` of the first ``nn.Linear`` that, with ``plan``'s inputs given ``x``, received a width
    other than its own (cross-attention's keys and values take the context's width); None when none did."""
    try:
        module = bind_context(build(probe).eval(), plan, probe)
    except Exception:  # does not build: nothing measured
        return None
    seen: list[tuple[str, int]] = []

    def hook(name):
        return lambda m, args: seen.append((name, m.in_features)) if args and isinstance(args[0], torch.Tensor) \
            and args[0].shape[-1] != m.in_features else None

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            module(torch.randn(1, 5, probe.d_in))
    except Exception:  # expected: the projection of another width raised
        pass
    finally:
        for h in hooks:
            h.remove()
    return seen[0] if seen else None

