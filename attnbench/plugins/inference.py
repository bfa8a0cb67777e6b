"""What a user's class computes, read from what it declares and shows, never by trying it against the reference.

* **KV cache**: ``forward`` takes ``use_cache`` and the class has a reset method (``reset_cache``,
  ``reset_kv_cache``, ``clear_cache``, ...). ``use_cache`` without one is an error: the decode timer and the
  decode property must be able to empty the cache.
* **Grouped/multi-query attention**: a constructor parameter or config field that names the key/value heads
  (``num_kv_heads``, ``n_kv_heads``, ``num_key_value_heads``, ``kv_heads``, the book's ``num_kv_groups``),
  confirmed on a probe: built with 6 heads of 4 and 3 kv heads, the key/value projections must come out
  ``3 × 4 = 12`` wide (a class that reads the name as a group size would give 8). A contradiction is an error.
* **Sliding window**: ``window``, ``sliding_window``, ``sliding_window_size``, ``attention_window`` (a bare
  ``window_size`` can size a cache, as in the book's optimized KV cache, so it is no evidence alone).
* **Non-causal**: ``causal`` or ``is_causal``.
* **Config objects** (``Attention(config)``): the fields the constructor reads on a probe are what it supports.

``attnbench_capabilities`` overrides every inference; ``attnbench check -v`` prints each with its evidence.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch

from attnbench.errors import PluginLoadError
from attnbench.plugins import import_state, signatures, stages
from attnbench.plugins.binding import (
    ALIASES,
    CUDA_WORDS,
    DISTRIBUTED_WORDS,
    PROBE,
    WINDOW_EVIDENCE,
    Binding,
    bind,
    capabilities,
)
from attnbench.plugins.cache_objects import SHAPES, cache_object_for, recognise
from attnbench.plugins.cache_probe import only_cache, with_probed_cache
from attnbench.plugins.cache_state import RESET_METHODS, reset_cache, reset_method, step_restorer
from attnbench.plugins.causal_probe import forward_is_causal, probe_mask
from attnbench.plugins.config_reads import config_fields_read
from attnbench.plugins.configs import with_own_config
from attnbench.plugins.context import PADDING, ContextPlan, arguments, bind_context, plan_for
from attnbench.plugins.encoder import LINE as ENCODER_LINE
from attnbench.plugins.encoder import is_encoder, sized
from attnbench.plugins.exits import plugin_exits
from attnbench.plugins.helper_args import rotates
from attnbench.plugins.loading import IMPORTED, first_line, import_failure
from attnbench.plugins.measured import apply_measured
from attnbench.plugins.module_cache import cache_attr, cache_builder
from attnbench.plugins.own_length import apply_max_length
from attnbench.plugins.own_rope import apply_own_rope
from attnbench.plugins.scale_flag import scale_by_flag
from attnbench.spec import AttnSpec

GQA_CONFIRM_PROBE = AttnSpec(d_in=20, d_out=24, context_length=9, dropout=0.0, num_heads=6, num_kv_heads=3)
"""6 heads of 4, 3 kv heads: keys and values 12 wide; a kv-head name read as a group size (2) would give 8."""
GUIDE = "docs/variants.md: Attention variants and KV-cache decoding"
EXTERNAL_CACHE = frozenset({"past_key_value", "past_key_values", "layer_past", "past", "cache", "kv_cache", "cache_position"})
"""``forward`` parameters that pass a cache in (Hugging Face, GPT-2 style): such a class keeps no cache of its own."""
CACHE_WORDS = frozenset({"past", "cache"})
"""Any other ``forward`` parameter with one of these words in its name passes a cache in too (bark's ``past_kv``)."""


def _forward_params(target) -> set[str]:
    forward = getattr(target, "forward", None) if inspect.isclass(target) else None
    if forward is None:
        return set()
    try:
        return set(signatures.signature(forward).parameters)
    except (TypeError, ValueError):
        return set()


def infer(target, binding: Binding, declared: dict, plan: ContextPlan | None = None) -> tuple[dict, list[str]]:
    """The variant capabilities of ``target`` (a class or factory, bound as ``binding``) and one line of
    evidence per inference; ``declared`` (``attnbench_capabilities``) wins and is not inferred.

    Raises :class:`PluginLoadError` for ``use_cache`` without a reset method and for a kv-head count the
    layout contradicts."""
    name = getattr(target, "__qualname__", repr(target))
    caps: dict = {}
    lines: list[str] = import_state.lines(target)
    read = config_fields_read(binding)
    if read is not None:
        lines.append(f"config fields read (what it reads is what it supports): {', '.join(read) or 'none'}")
        names, where = set(read), "reads config field"
    elif binding.style == "keywords":  # a role a probe gave (plugins.roles) counts as its field's first name
        names, where = {p for p, _ in binding.params} | {ALIASES[f][0] for p, f in binding.params
                                                         if f in ALIASES and p not in ALIASES[f]}, "constructor takes"
    else:
        names, where = set(), ""

    kv_names = [p for p, f in binding.params if f == "num_kv_heads"] + [n for n in ALIASES["num_kv_heads"] if n in names]
    if kv_names and "gqa" not in declared:
        caps["gqa"] = True
        lines.append(f"gqa: yes ({where} {kv_names[0]}, the number of key/value heads; {_confirm_kv(binding, name, kv_names[0])})")
    window_names = [n for n in WINDOW_EVIDENCE if n in names]
    if window_names and "sliding_window" not in declared:
        caps["sliding_window"] = True
        lines.append(f"sliding_window: yes ({where} {window_names[0]})")
    elif "window_size" in names and "sliding_window" not in declared:
        lines.append("sliding_window: no (window_size alone can size a cache; declare "
                     "attnbench_capabilities = {'sliding_window': True} if it is a sliding window)")
    causal_names = [n for n in ALIASES["causal"] if n in names] + [p for p, _ in binding.causal_flags]
    if causal_names and "non_causal" not in declared:
        caps["non_causal"] = True
        lines.append(f"non_causal: yes ({where} {causal_names[0]})")

    positional, positional_lines = _positional(binding, names, where, declared, plan)
    caps.update(positional)
    lines += positional_lines
    forward = _forward_params(target)
    external = sorted(n for n in forward if n in EXTERNAL_CACHE or (n != "use_cache" and CACHE_WORDS & set(n.lower().split("_"))))
    if plan is not None:
        context_caps, context_lines = infer_context(binding, plan, declared)
        _merge(caps, context_caps)
        lines += context_lines
    elif "use_cache" in forward and external and "kv_cache" not in declared:
        lines.append(f"kv_cache: no (forward takes use_cache with {external[0]}: the cache is passed in, not kept by the class)")
    elif "use_cache" in forward and "kv_cache" not in declared:
        reset = reset_method(target)
        if reset is None:
            raise PluginLoadError(f"{name}.forward takes use_cache but the class has no method to empty its cache "
                                  f"({', '.join(RESET_METHODS[:3])}, ...); add reset_cache(), or declare "
                                  f"attnbench_capabilities = {{'kv_cache': False}} ({GUIDE})")
        caps["kv_cache"] = True
        how = "rewind_cache() rewinds a step" if callable(getattr(target, "rewind_cache", None)) else \
            f"no rewind_cache: the decode timer restores the cache state after each step; {_confirm_restorable(binding, name)}"
        lines.append(f"kv_cache: yes (forward takes use_cache, the class has {reset}(); {how})")
    for key in sorted(set(declared) & {"gqa", "sliding_window", "non_causal", "kv_cache"}):
        lines.append(f"{key}: {'yes' if declared[key] else 'no'} (declared in attnbench_capabilities)")
    return caps, lines


def _positional(binding: Binding, names: set[str], where: str, declared: dict, plan) -> tuple[dict, list[str]]:
    """:func:`infer_positional`, with a constructor's theta ignored when a probe finds that nothing rotates (mamba's
    ``rotary_emb_base`` with ``rotary_emb_dim=0``; lingua's beside the tables its forward takes, which carry the
    rotation)."""
    lines = []
    theta = next((n for n in ALIASES["rope_theta"] if n in names), None)
    if theta and "rope" not in declared and stages.theta_rotates(
            binding, binding.probe, None if plan is None else lambda m, s: bind_context(m, plan, s)) is False:
        names = names - set(ALIASES["rope_theta"])
        lines.append(f"rope: {'from the tables its forward takes' if plan is not None and plan.tables else 'no'} "
                     f"(constructor takes {theta}, but a probe found it inert: built at theta 10000 and at 100 with the "
                     "same parameters the class gives the same output, and the last token's output stays when the "
                     "tokens before it are permuted)")
    caps, more = infer_positional(binding, names, where, declared)
    return caps, lines + more


def _merge(caps: dict, more: dict) -> None:
    """``more`` into ``caps``, the lists of what a class requires and refuses joined, not replaced."""
    for key in ("requires", "refuses"):
        both = (*caps.get(key, ()), *more.pop(key, ()))
        caps.update({key: tuple(dict.fromkeys(both))} if both else {})
    caps.update(more)


def infer_positional(binding: Binding, names: set[str], where: str, declared: dict) -> tuple[dict, list[str]]:
    """RoPE, QK-norm, score scale and soft-capping a class owns, from its constructor's (or config's) names and
    its q/k norms on a probe. ``requires`` lists the fields it always applies (a spec without them is skipped)."""
    caps: dict = {}
    lines: list[str] = []
    requires: list[str] = []
    theta = [n for n in ALIASES["rope_theta"] if n in names]
    if theta and "rope" not in declared:
        caps["rope"] = ("half",)
        requires.append("rope_theta")
        lines.append(f"rope: half ({where} {theta[0]}: the class builds its own tables, with the theta the spec gives; "
                     "declare attnbench_capabilities = {'rope': ('interleaved',)} for GPT-J/Meta pairs)")
        partial = [n for n in (*ALIASES["rope_head_dim"], *ALIASES["rope_fraction"]) if n in names]
        if partial and "rope_partial" not in declared:
            caps["rope_partial"] = True
            lines.append(f"rope_partial: yes ({where} {partial[0]}: it rotates the part of each head the spec's "
                         "rope_head_dim says, the rest unrotated)")
        if "rope_scaling" not in names:
            caps["refuses"] = ("rope_scaling",)
            lines.append("rope_scaling: no (nothing the class takes says it scales its tables)")
    switch = [n for n in ALIASES["qk_norm"] if n in names]
    placement = _norm_placement(binding, "head" if switch else None)
    if placement and "qk_norm" not in declared:
        caps["qk_norm"] = (placement,)
        if not switch:
            requires.append("qk_norm")
        lines.append(f"qk_norm: {placement} ({f'{where} {switch[0]}; ' if switch else 'always on: '}its q/k norms "
                     f"are {'per head' if placement == 'head' else 'over the whole projection'} on a probe)")
        if not any(n in names for n in ALIASES["norm_eps"]):
            eps = _measured_eps(binding, placement)
            if eps is None:
                caps["refuses"] = (*caps.get("refuses", ()), "norm_eps")
                lines.append("norm_eps: its own, not measurable (nothing the class takes sets its norms' epsilon, "
                             "and its q norm's output on constant rows fits no epsilon: a spec with another norm_eps "
                             "is skipped)")
            else:
                caps["own"] = {"norm_eps": eps}
                lines.append(f"norm_eps: its own, {eps:g} (nothing the class takes sets it; measured on constant "
                             f"rows at unit gain): every QK-norm case is checked at {eps:g}")
    for key, field in (("score_scale", "query_pre_attn_scalar"), ("softcap", "softcap")):
        found = [n for n in ALIASES[field] if n in names]
        if found and key not in declared:
            caps[key] = True
            lines.append(f"{key}: yes ({where} {found[0]})")
    low_rank = _low_rank(binding)
    if low_rank is not None and "backward" not in declared:
        caps["backward"] = ()
        lines.append(f"mla: yes ({low_rank.down} -> latent -> {low_rank.up_k}/{low_rank.up_v}: the reference takes the "
                     "composed W_k = W_UK @ W_DKV from the module; no backward cases, a composed weight's gradient has "
                     "no canonical counterpart)")
    if requires:
        caps["requires"] = tuple(requires)
    return caps, lines


def _measured_eps(binding: Binding, placement: str) -> float | None:
    """The epsilon of the class's q norm, measured on a probe (:func:`~attnbench.plugins.qk_norm.measure_eps`)."""
    from attnbench.plugins.qk_norm import measure_eps

    probe = replace(binding.probe, qk_norm=placement)
    try:
        return measure_eps(binding(probe), probe)
    except Exception:  # does not build at the probe's sizes, or its norm is no RMSNorm: nothing inferred
        return None


ODD_PROBE = AttnSpec(d_in=6, d_out=6, context_length=6, dropout=0.0, num_heads=2)
"""head_dim 3: what a class that always rotates q and k by pairs cannot take."""


def even_head_dim_reason(binding: Binding, plan: ContextPlan | None, rotates: bool) -> str | None:
    """Why a class that always applies RoPE cannot take an odd head dim (what a probe with head_dim 3 raised when
    the same class runs at head_dim 4), or ``None``: it takes odd head dims, or it does not always rotate."""

    if not rotates:
        return None
    outcomes = []
    for probe in (PROBE, ODD_PROBE):  # no theta: the neutral tables attnbench supplies (an odd RoPE spec is invalid)
        try:
            module = binding(probe).eval()
            if plan is not None:
                module = bind_context(module, plan, probe)
            with torch.no_grad():
                module(torch.randn(1, 3, probe.d_in))
            outcomes.append(None)
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {first_line(exc)}"[:160])
    even, odd = outcomes
    return odd if even is None and odd is not None else None


def window_offset(binding: Binding, plan: ContextPlan | None) -> int | None:
    """How many keys the class's window ``w`` keeps per query, less ``w``, measured on a probe without any reference:
    0 when it keeps ``w`` (the current token included, attnbench's convention), 1 when it keeps the current token and
    ``w`` before it (``i - j <= w``); ``None`` when the probe says neither (the cases show what it does)."""
    probe = replace(binding.probe, window=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, probe.context_length, probe.d_in, generator=g)
    try:
        module = binding(probe).eval()
        module = bind_context(module, plan, probe) if plan is not None else module
        with torch.no_grad():
            base = module(x)
            base = (base[0] if isinstance(base, tuple) else base)[0, -1]
            seen = 0
            for j in range(x.shape[1]):  # which tokens move the last output: the keys its window keeps
                x2 = x.clone()
                x2[0, j] += torch.randn(probe.d_in, generator=g)
                out = module(x2)
                out = (out[0] if isinstance(out, tuple) else out)[0, -1]
                seen += bool((out - base).abs().max() > 1e-5 * base.abs().max().clamp_min(1e-6))
    except Exception:  # does not build or run at the probe's sizes: nothing inferred
        return None
    return seen - 3 if seen in (3, 4) else None


def _low_rank(binding: Binding):
    """The MLA down/up projections of the class built on a probe (:mod:`~attnbench.plugins.mla`), or ``None``."""
    from attnbench.plugins.mla import find_low_rank

    probe = binding.probe
    try:
        return find_low_rank(dict(binding(probe).named_modules()), probe)
    except Exception:  # does not build at the probe's sizes: the cases show what it does
        return None


def _norm_placement(binding: Binding, qk_norm: str | None) -> str | None:
    """Where the class's q/k norms sit (``head`` or ``full``) when built on a probe with ``qk_norm``; ``None``
    when it has none there (or does not build, also with a theta: a class that builds its own tables from a required
    one, as the book's Qwen3 ``GroupedQueryAttention(..., rope_theta, qk_norm)`` does)."""
    from attnbench.plugins.qk_norm import NormError, find_gains

    probe = replace(binding.probe, qk_norm=qk_norm)
    try:
        try:
            module = binding(probe)
        except Exception:  # noqa: BLE001 - perhaps it needs a theta; if it still does not build, the outer except
            probe = replace(probe, rope_theta=probe.rope_theta or 10000.0)
            module = binding(probe)
        gains = find_gains(module, probe)
    except NormError as exc:
        raise PluginLoadError(f"{getattr(binding.target, '__qualname__', binding.target)}'s QK-norm: {exc} ({GUIDE})") from None
    except Exception:  # does not build at the probe's sizes: the cases show what it does
        return None
    return gains[0].placement if gains else None


def plan_with_probe(target, binding: Binding, probe: bool = True) -> ContextPlan | None:
    """The context ``target.forward`` takes (:func:`~attnbench.plugins.context.plan_for`), its mask and table forms
    decided on a probe (``probe``; else as planned, for a context with nothing to choose); ``None`` for a
    ``forward(x)``."""
    plan = plan_for(target)
    if plan is None:
        return only_cache(binding) if probe and cache_attr(target) is None else None
    if plan.cache is None:
        attr = cache_attr(target)
        plan = replace(plan, attr_cache=attr, cache_builder=cache_builder(target) if attr else None)
    if not probe and (plan.mask or plan.tables or plan.probed or plan.position or plan.causal_arg):
        return None
    plan = probe_mask(binding, plan, binding.probe) if probe else plan
    plan = with_probed_cache(binding, plan) if probe else plan
    if plan.cache is not None and not plan.buffers and _returns_cache(binding, plan) is not None:
        kind = _cache_object_kind(target, binding, plan)
        plan = replace(plan, cache_object=kind) if kind else plan
    return plan


def _cache_object_kind(target, binding: Binding, plan: ContextPlan) -> str | None:
    """The kind of cache object a forward that returns no next cache takes (:func:`~attnbench.plugins.cache_objects.
    recognise`): the class's declared one, or the shape the first attribute its forward reads from it names."""
    probe = binding.probe

    def run_with(obj):
        module = bind_context(binding(probe).eval(), plan, probe)
        module._attnbench_cache = obj
        with torch.no_grad(), plugin_exits("a probe of its cache object"):
            module(torch.randn(1, 3, probe.d_in), use_cache=True)

    return recognise(run_with, target)


def infer_context(binding: Binding, plan: ContextPlan, declared: dict) -> tuple[dict, list[str]]:
    """What a forward that takes its context supports: any mask content (sliding windows, non-causal) when it
    takes a mask, a KV cache when it returns the next cache on a probe step."""
    caps: dict = {}
    lines = list(plan.describe())
    turning = [n for n, cls in plan.helpers if rotates(cls)]
    if turning and "rope" not in declared:
        caps.update(rope=("half",), requires=("rope_theta",), refuses=("rope_scaling",))
        lines.append(f"rope: half ({turning[0]} is a module of its own code whose constructor takes a theta: it always "
                     "rotates, by the spec's theta; specs without RoPE, or with a RoPE scaling, are skipped)")
    if plan.tables and "rope" not in declared:
        caps["rope"] = (plan.rope_style,)
        lines.append(f"rope: {plan.rope_style} (forward takes {', '.join(plan.tables)}: attnbench supplies the spec's tables)")
    if plan.window_arg and not plan.mask and "sliding_window" not in declared:
        caps["sliding_window"] = True
        lines.append(f"sliding_window: yes (forward takes {plan.window_arg}: attnbench supplies the spec's window)")
    if plan.mask and plan.mask_form is not None and plan.mask_form.dims == PADDING:
        caps.update({key: False for key in ("sliding_window", "non_causal") if key not in declared})
        lines.append(f"sliding_window, non_causal: no (forward takes {plan.mask} as a (B, T) padding mask, which hides "
                     "no key here; the class masks the future itself)")
    elif plan.mask:
        read = _mask_content_read(binding, plan)
        for key in ("sliding_window", "non_causal"):
            if key not in declared:
                caps[key] = read
                lines.append(f"{key}: yes (forward takes {plan.mask}: attnbench supplies the mask's content)" if read
                             else f"{key}: no (forward takes {plan.mask}, but a probe found its content ignored: a "
                                  "windowed mask gives the causal output, so only whether one is passed counts)")
    if plan.attr_cache and "kv_cache" not in declared:
        caps["kv_cache"] = True
        lines.append(f"kv_cache: yes (forward reads self.{plan.attr_cache}, a cache object its caller installs; a "
                     "step is undone by restoring that object's state)")
    if plan.cache and plan.buffers and "kv_cache" not in declared:
        caps["kv_cache"] = True
        lines.append(f"kv_cache: yes (forward takes {plan.cache}, key and value buffers its caller preallocates and "
                     "the class writes in place; a step is undone by restoring them)")
    elif plan.cache and plan.cache_object and "kv_cache" not in declared:
        caps["kv_cache"] = True
        lines.append(f"kv_cache: yes (forward takes {plan.cache}, a cache object its caller passes in and advances; "
                     + ("the class declares attnbench_cache_object)" if plan.cache_object == "declared" else
                        f"it reads {next(k for k, v in SHAPES.items() if v == plan.cache_object)} from it on a probe: "
                        f"attnbench passes {cache_object_for(None, plan.cache_object).words})"))
    elif plan.cache and "kv_cache" not in declared:
        returned = _returns_cache(binding, plan)
        caps["kv_cache"] = returned is None
        lines.append(f"kv_cache: yes (forward takes {plan.cache} and returns the next cache; a step is undone by "
                     f"putting the previous cache back)" if returned is None else
                     f"kv_cache: no (forward takes {plan.cache}, but {returned}: the cache is passed in, not kept by the class)")
    return caps, lines


def _mask_content_read(binding: Binding, plan: ContextPlan) -> bool:
    """Does the class read its mask's content? On a probe, a 2-key window in the chosen form changes the output of a
    causal one (Whisper's SDPA path only asks whether a mask is passed). True when the probe cannot tell."""
    probe = replace(binding.probe, causal=True, window=None)
    try:
        module = binding(probe).eval()
        x = torch.randn(1, 6, probe.d_in, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outs = []
            for spec in (probe, replace(probe, window=2)):
                kwargs = arguments(replace(plan, mask_required=True), spec, x, 0, None, False)
                out = module(x, **{k: v for k, v in kwargs.items() if k != plan.x})
                outs.append(out[0] if isinstance(out, tuple) else out)
    except Exception:  # the cases will show what it does with a window
        return True
    return not torch.allclose(outs[0], outs[1])


def _returns_cache(binding: Binding, plan: ContextPlan) -> str | None:
    """``None`` when a probe step returns a next cache, else what it does instead, in words."""
    probe = binding.probe
    try:
        module = bind_context(binding(probe).eval(), plan, probe)
        with torch.no_grad():
            module(torch.randn(1, 3, probe.d_in), use_cache=True)
    except Exception as exc:
        return f"a probe step raised {type(exc).__name__}: {exc}"
    return None if module._attnbench_cache is not None else "a probe step returned no next cache"


def _confirm_restorable(binding: Binding, name: str) -> str:
    """Decode one token on a probe, restore, decode it again: what the step changes, in words; raises
    :class:`~attnbench.plugins.cache_state.CacheRestoreError` when the restored step decodes another token
    (the class is compared with itself, never with the reference)."""
    probe = binding.probe
    try:
        module = binding(probe).eval()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 4, probe.d_in, generator=g)
        with torch.no_grad():
            reset_cache(module)
            module(x[:, :3].contiguous(), use_cache=True)
    except Exception:  # does not build or prefill at the probe's sizes: the decode cases show what it does
        return "its state was not probed (it does not run at the probe's sizes)"
    restore = step_restorer(module, lambda: module(x[:, 3:].contiguous(), use_cache=True), name)
    return f"a step {restore.describe()}"


def _confirm_kv(binding: Binding, name: str, param: str) -> str:
    """Check on :data:`GQA_CONFIRM_PROBE` that the key/value projections are ``num_kv_heads × head_dim`` wide;
    the words of the confirmation, or :class:`PluginLoadError` when the layout contradicts the name."""
    from attnbench.plugins.layout import MappingError, discover

    probe = GQA_CONFIRM_PROBE
    if binding.same_width_only:
        probe = replace(probe, d_in=probe.d_out)
    try:
        module = binding(probe)
    except Exception:  # refuses the probe's sizes: the cases show what it computes
        return "not confirmed: it does not build at the probe's sizes"
    try:
        discover(module, probe, has_qkv_bias=False)
    except MappingError as exc:
        about_kv = [p for p in exc.problems if "W_k" in p or "W_v" in p]
        if about_kv:
            raise PluginLoadError(
                f"{name} takes {param} as the number of key/value heads, but built with num_heads={probe.num_heads}, "
                f"{param}={probe.num_kv_heads} its key/value projections are not {probe.num_kv_heads} x head_dim "
                f"{probe.head_dim} = {probe.kv_dim} wide ({about_kv[0]}); if {param} means something else, declare "
                f"attnbench_capabilities = {{'gqa': False}} and give it a default ({GUIDE})") from None
        return "not confirmed: its weights do not map at the probe's sizes"
    except Exception:
        return "not confirmed: its weights do not map at the probe's sizes"
    return f"confirmed: with {probe.num_kv_heads} kv heads of {probe.head_dim} its key/value projections are {probe.kv_dim} wide"




def environment_cause(exc: BaseException) -> str | None:
    """Why a constructor cannot run on this machine, when what it raised says so: a missing package, CUDA
    (``.cuda()`` on a machine without it), or a distributed/model-parallel setup nobody initialised."""
    if isinstance(exc, ImportError):
        return import_failure("it imports at build time and", exc).removeprefix("it imports at build time and failed: ")
    text = f"{type(exc).__name__}: {first_line(exc)}"
    lowered = text.lower()
    if any(w in lowered for w in CUDA_WORDS) and not torch.cuda.is_available():
        return f"it needs CUDA, which this machine does not have ({text})"
    if any(w in lowered for w in DISTRIBUTED_WORDS):
        return f"it needs a distributed/model-parallel setup that is not initialised in this process ({text})"
    return None


def _causal_stage(obj, binding: Binding) -> tuple[Binding, ContextPlan | None]:
    """The context plan, after the class is known to be causal: with its default flags, else with a constructor flag
    that a probe finds makes it so (:func:`~attnbench.plugins.stages.causal_by_flag`). A class no flag makes causal
    keeps its plan's refusal, or (a ``forward(x)``) is left to the causal cases."""
    try:
        plan = plan_with_probe(obj, binding)
    except PluginLoadError as exc:
        retried = _time_first(obj, binding) or _bias_held(obj, binding, exc)
        if retried is not None:
            return retried
        if "not causal" not in str(exc):
            raise
        flagged = stages.causal_by_flag(binding, lambda b: plan_with_probe(obj, b) is not None)
        if flagged is not None:
            return flagged, plan_with_probe(obj, flagged)
        plain = _nothing_to_choose(obj, binding) or _said_causal(obj, binding)
        if plain is None:
            raise
        return binding, plain
    if plan is not None:
        return (replace(binding, encoder=True) if plan.encoder else binding), plan
    return _forward_x_causal_stage(binding), plan


def _nothing_to_choose(obj, binding: Binding) -> ContextPlan | None:
    """The plan of a forward that runs but is not causal, left to the causal cases as a ``forward(x)`` is (a class
    that mixes tokens where it splits its heads fails them, and is localised): one whose context gives attnbench
    nothing to make it causal with (only a cache: no mask, tables, position or flag), or one whose optional mask, left
    at None, gives inf or nan (a softmax left out: ``-inf`` scores used as weights); None otherwise."""
    try:
        cache_only = plan_with_probe(obj, binding, probe=False)
        plan = cache_only or _mask_left_out(obj)
        if plan is None:
            return None
        module = bind_context(binding(binding.probe).eval(), plan, binding.probe)
        with torch.no_grad(), plugin_exits("a probe of its forward"):
            out = module(torch.randn(1, 3, binding.probe.d_in))
    except Exception:  # it does not run so: the refusal stands
        return None
    if cache_only is not None:
        return plan
    out = out[0] if isinstance(out, tuple | list) else out
    return plan if isinstance(out, torch.Tensor) and not bool(out.isfinite().all()) else None


def _said_causal(obj, binding: Binding) -> ContextPlan | None:
    """The plan of a class no mask form makes causal though its forward says it is causal
    (:mod:`~attnbench.plugins.causal_intent`): checked, its causal cases localised; None otherwise."""
    from attnbench.plugins.causal_probe import checked_anyway

    plan = plan_for(obj)
    return None if plan is None else checked_anyway(binding, plan, binding.probe)


def _mask_left_out(obj) -> ContextPlan | None:
    """The plan of a forward whose only context is an optional mask (and an optional position), left at None."""
    plan = plan_for(obj)
    if (plan is None or not plan.mask or plan.mask_required or plan.tables or plan.probed
            or (plan.position and not plan.position_optional)):
        return None
    return replace(plan, mask=None, unmasked=plan.mask, position_none=bool(plan.position))


def _time_first(obj, binding: Binding) -> tuple[Binding, ContextPlan | None] | None:
    """``(binding, plan)`` checked time first (:mod:`~attnbench.plugins.time_first`) when no mask form ran as given
    and one does with the sequence inputs transposed; None otherwise (the first refusal stands)."""
    from attnbench.plugins.time_first import NOTE

    if binding.time_first or binding.channels_first:
        return None
    flipped = replace(binding, time_first=True, notes=(*binding.notes, NOTE))
    try:
        plan = plan_with_probe(obj, flipped)
    except PluginLoadError:
        return None
    return (flipped, plan) if plan is not None and _mixes_tokens(flipped, plan) else None


BIAS_HELD = ("{param}=True always: with {param}=False no form of its forward ran, with it True one does (decided by a "
             "probe); the cases without q/k/v biases load zeros into them")


def _bias_held(obj, binding: Binding, exc: PluginLoadError) -> tuple[Binding, ContextPlan | None] | None:
    """``(binding, plan)`` with the constructor's q/k/v bias switch held ``True`` when no form of the forward ran
    with it off and one does with it on (ESM's fairseq layer concatenates ``q_proj.bias``, ``k_proj.bias`` and
    ``v_proj.bias`` on its fast path), as given or time first; None otherwise (the first refusal stands)."""
    param = next((p for p, f in binding.params if f == "qkv_bias"), None)
    if param is None or binding.style != "keywords" or "raises" not in str(exc):
        return None
    held = replace(binding, params=tuple(p for p in binding.params if p[0] != param), extras=(*binding.extras,
                   (param, True)), notes=(*binding.notes, BIAS_HELD.format(param=param)))
    try:
        plan = plan_with_probe(obj, held)
    except PluginLoadError:
        return _time_first(obj, held)
    return (held, plan) if plan is not None else None


def _mixes_tokens(binding: Binding, plan: ContextPlan) -> bool:
    """Whether the first token moves the later tokens' outputs (a causal layer attends over its tokens): transposed
    wrongly, a batch-first class would attend over the batch, each token on its own, which is causal too."""
    spec = binding.probe
    x = torch.randn(2, 5, spec.d_in, generator=torch.Generator().manual_seed(3))
    other = x.clone()
    other[:, 0] += 1.0
    try:
        module = bind_context(binding(spec).eval(), plan, spec)
        with torch.no_grad(), plugin_exits("a probe of its layout"):
            a, b = (module(t) for t in (x, other))
    except Exception:  # does not run so: not this layout
        return False
    a, b = (t[0] if isinstance(t, tuple | list) else t for t in (a, b))
    return bool((a[:, 1:] - b[:, 1:]).abs().max() > 1e-6 * a.abs().max())


def _forward_x_causal_stage(binding: Binding) -> Binding:
    """A ``forward(x)`` class that is not causal as built: the constructor flag that makes it causal, if one does."""
    if not stages.bool_flags(binding):  # nothing to flip: an encoder's (ViT's) attention, or causal as it is
        return replace(binding, encoder=True) if is_encoder(binding, binding.probe, sized=sized(binding)) else binding
    probe = replace(binding.probe, causal=True)
    if forward_is_causal(binding, probe):
        return binding
    flagged = stages.causal_by_flag(binding, lambda b: forward_is_causal(b, probe))
    if flagged is not None:
        return flagged
    return replace(binding, encoder=True) if is_encoder(binding, binding.probe, sized=sized(binding)) else binding


def _factory(binding: Binding, has_bias: bool, plan, requires, refuses, own: dict, declared: dict, evidence: list):
    """The implementation factory of ``binding``, with a constructor flag that switches the score scale on set by
    the scale it causes (:func:`~attnbench.plugins.scale_flag.scale_by_flag`; its note added to ``evidence``)."""
    from attnbench.plugins.layout import with_layout

    def make(b: Binding):
        return with_layout(b, has_qkv_bias=has_bias, context=plan, requires=requires, refuses=refuses, own=dict(own))

    factory = make(binding)
    if "score_scale" not in declared:
        binding, factory, note = scale_by_flag(binding, make, factory)
        evidence += [note] if note else []
    return factory


def _takes_mask(target) -> bool:
    """Does ``target.forward`` take a mask attnbench supplies (so the mask, not a config field, carries a window)?"""
    try:
        plan = plan_for(target)
    except PluginLoadError:  # reported where the plan is made, after the class is known to build here
        return False
    return plan is not None and plan.mask is not None


def implementation_fields(obj, source: str) -> dict:
    """The :class:`~attnbench.registry.Implementation` fields of a user's class or factory: its bound
    constructor wrapped with weight-layout discovery, what the constructor says it supports, and its
    declared ``attnbench_capabilities`` (which win over what is inferred)."""

    binding = with_own_config(bind(obj), skip=("window",) if _takes_mask(obj) else ())
    try:
        binding = stages.construct(binding, binding.probe, environment_cause)
        binding = stages.ints_by_shape(stages.bias_by_flag(binding, binding.probe), binding.probe)
    except stages.ConstructionError as exc:  # raised again at build: the first cause, before any later probe
        return {"factory": stages.raising_factory(binding, exc), "source": source}
    inferred: dict = {}
    if binding.same_width_only:
        inferred["same_width_only"] = True
    if binding.style == "keywords" and "dropout" not in binding.fields:
        inferred["dropout"] = ()  # nothing to pass the rate to: the class has no attention dropout
    declared = capabilities(obj)
    binding, plan = _causal_stage(obj, binding)
    variants, evidence = infer(obj, binding, declared, plan)
    caps = {**inferred, **variants, **declared}
    own = dict(caps.pop("own", {}))
    if binding.style == "keywords" and not {"num_heads", "head_dim", "config"} & binding.fields:
        own["heads"] = 1  # no parameter sets its heads: one head (g-mlp's Attention)
        evidence.append("heads: always 1 (no constructor parameter sets the number of heads or their size): cases "
                        "with more heads are skipped")
    if "gqa" not in declared and stages.always_one_kv_head(binding, binding.probe):
        own["kv_heads"], caps["gqa"] = 1, True
        evidence.append("kv heads: always 1 (multi-query: built for 4 heads, its weight matrices hold one key/value "
                        "head's, and no constructor parameter sets them): cases with other kv heads are skipped")
    rotates = bool(plan is not None and plan.tables)  # own tables (requires rope_theta): own_spec refuses odd head dims
    odd = even_head_dim_reason(binding, plan, rotates)
    if odd is not None:
        own["even_head_dim"] = odd
        evidence.append(f"head_dim: even only (it always rotates q and k by pairs; at head_dim 3 a probe raised {odd}): "
                        "cases with an odd head dim are skipped")
    evidence += apply_max_length(binding, plan, own)
    if binding.encoder and "non_causal" not in declared:
        own["encoder"], caps["non_causal"] = True, True
        evidence.append(ENCODER_LINE)
    has_bias = "qkv_bias" in binding.fields
    if binding.style == "config":  # a config offers every field: what the class reads on a probe says what it has
        read = config_fields_read(binding)
        has_bias = read is None or any(n in read for n in ALIASES["qkv_bias"])
        if read is not None and not any(n in read for n in ALIASES["dropout"]) and "dropout" not in declared:
            caps["dropout"] = ()  # it never reads a dropout rate: it has no attention dropout
    if caps.get("sliding_window") and "sliding_window" not in declared and not (plan is not None and plan.mask):
        if window_offset(binding, plan) == 1:
            own["window_offset"] = 1
            evidence.append("window: counts the current token apart (built with window=3 on a probe, each query kept 4 "
                            "keys: i - j <= window): for a spec window of N keys it is built with window N - 1")
    has_bias = has_bias and caps.pop("qkv_bias", True) is not False  # declared: no q/k/v bias (an adapter's)
    factory = _factory(binding, has_bias, plan, caps.pop("requires", ()), caps.pop("refuses", ()), own, declared,
                       evidence)
    evidence += apply_own_rope(factory, caps, declared, obj)
    evidence += apply_measured(factory, caps, declared, obj)
    factory.evidence = evidence
    factory.imported = IMPORTED.get(getattr(obj, "__module__", ""), "")
    return {"factory": factory, **caps, "source": caps.get("source", source)}
