"""The first true cause: a user's class is taken through its stages in order, and a refusal names the first that failed.

import (:mod:`attnbench.plugins.loading`) -> binding (:func:`~attnbench.plugins.binding.bind`, roles by probes) ->
**construction** -> **dtype** -> forward context (mask, tables, positions, cache: :mod:`attnbench.plugins.context`) ->
**causality** -> cases. A later symptom ("not causal with any mask form") is said only when every earlier stage
succeeded: a constructor that raises at every probe size is refused here with the call tried and what it raised; a
class whose weights are built in another dtype than the default's (``nn.Linear(..., dtype=torch.bfloat16)`` through a
class attribute, ``.half()`` in ``__init__``) is cast as a whole, and ``-v`` says so; a class that is causal only with a
boolean constructor flag flipped (``causal=False`` by default, under any name) gets the flag set by the spec's
causality, decided by the behaviour it causes.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.plugins.binding import Binding, dropout_modules
from attnbench.plugins.inner_modules import inner_module, no_weights
from attnbench.plugins.library_version import written_for_another
from attnbench.plugins.roles import first_line, weight_elements, whole_block
from attnbench.plugins.signatures import signature
from attnbench.spec import AttnSpec

ROOMY = AttnSpec(d_in=64, d_out=64, context_length=16, dropout=0.0, num_heads=4, rope_theta=10000.0)
"""A second size for the construction stage: powers of two, a head dim of 16 (some classes refuse 24 wide, 4 heads)."""
ADAPT_HINT = "`attnbench adapt FILE:Class` writes a small adapter with a TODO for what attnbench could not solve"


class ConstructionError(PluginLoadError):
    """The class's constructor raised at every probe size: the first true cause, raised again when it is built, never
    followed by a later stage's symptom."""


def raising_factory(binding: Binding, exc: ConstructionError):
    """A factory that raises ``exc`` when built: resolving the class does not fail (a run records its cells' errors;
    ``check`` reports it once, before any case), and no later probe runs on a class that cannot be built."""

    def factory(spec: AttnSpec):
        raise PluginLoadError(str(exc)) from None

    factory.evidence, factory.imported, factory.binding = [], "", binding
    return factory


def _name(binding: Binding) -> str:
    return getattr(binding.target, "__qualname__", repr(binding.target))


def construct(binding: Binding, probe: AttnSpec, environment_cause) -> Binding:
    """``binding`` once its class is known to build here (else one :class:`PluginLoadError`: the environment it needs,
    or the call tried and what it raised at both sizes), cast as a whole when its weights come out in another dtype."""
    _not_a_layer(binding)
    built, failures, first = None, [], None
    for spec in (replace(probe, rope_theta=10000.0), ROOMY):
        try:
            built = binding(spec)
            break
        except Exception as exc:
            cause = environment_cause(exc)
            if cause is not None:
                raise PluginLoadError(f"{_name(binding)} cannot be built on this machine: {cause}; run it where that is "
                                      "available, or point --impl at a factory that builds it for one process on this "
                                      "device") from None
            failures.append(f"{type(exc).__name__}: {first_line(exc)}")
            first = first or exc
    if built is None and binding.style == "config" and binding.config_factory is not None:
        binding, built = _with_generic_config(binding, probe, failures[0])
    if built is None:
        version = written_for_another(first)
        if version is not None:
            raise ConstructionError(f"{_name(binding)} cannot be built: {version}",
                                    details=[f"{binding.describe()} raised {failures[0]}"],
                                    fix="install the version of that library the class's repository pins, or set the field in an "
                                        "adapter (`attnbench adapt FILE:Class`)") from None
        raise ConstructionError(f"{_name(binding)} cannot be built: {binding.describe()} raised {failures[0]} (and at "
                                f"d_model 64, 4 heads: {failures[-1]}); {ADAPT_HINT}") from None
    block = whole_block(built, spec)
    if block is not None:
        raise PluginLoadError(f"{_name(binding)} is a whole block, not an attention layer: {block}; check the attention class "
                              "itself (FILE:Class)")
    kernel = no_weights(built)
    if kernel is not None:
        raise PluginLoadError(f"{_name(binding)} is not an attention layer: {kernel}",
                              fix="check the layer that projects x and calls it (FILE:Class)")
    return with_channels_first(with_dtype(_theta_for_probes(binding, probe), built), built)


def _theta_for_probes(binding: Binding, probe: AttnSpec) -> Binding:
    """``binding`` with a rotary base for its probes when it builds only with one (EAGLE's ``LlamaRotaryEmbedding``:
    ``base ** ...`` of a ``None`` theta): every later probe then builds it, not only those that set a theta."""
    if probe.rope_theta is not None:
        return binding
    try:
        binding(probe)
        return binding
    except Exception:  # noqa: BLE001 - it built at theta 10000 above: the theta is what it needs
        return replace(binding, probe_theta=10000.0)


def _with_generic_config(binding: Binding, probe: AttnSpec, raised: str):
    """``(binding, module)`` built with attnbench's config, which carries every alias, when the class's own config type
    could not build it (EAGLE's 4.x-era ``LlamaAttention(config: LlamaConfig)`` raises inside transformers 5's
    ``LlamaConfig``); ``(binding, None)`` when that fails too."""
    generic = replace(binding, config_factory=None,
                      config_note=f"<attnbench's config: its own config type {binding.config_note.split('(')[0]} raised "
                                  f"{raised}>")
    try:
        return generic, generic(replace(probe, rope_theta=10000.0))
    except Exception:  # noqa: BLE001 - the own type's failure is the one named
        return binding, None


def _not_a_layer(binding: Binding) -> None:
    """Refuse a class whose constructor takes a module its forward calls (an inner attention its caller builds)."""
    try:
        params = list(signature(binding.target).parameters.values())
    except (TypeError, ValueError):
        return
    inner = inner_module(binding.target, params, {p for p, _ in binding.modules} | dropout_modules(binding.target))
    if inner is not None:
        raise PluginLoadError(f"{_name(binding)} is not a whole attention layer by itself: {inner}",
                              fix=f"{ADAPT_HINT} (the module to build), or check a class that builds it with its inner "
                                  "attention")


def with_channels_first(binding: Binding, module) -> Binding:
    """``binding`` checked as channels last when ``module``'s projections are pointwise ``Conv1d`` on ``(B, C, T)``
    (:mod:`attnbench.plugins.channels_first`), and ``-v`` says so."""
    from attnbench.plugins.channels_first import NOTE, pointwise_convs

    names = pointwise_convs(module) if isinstance(module, nn.Module) and not binding.channels_first else []
    if not names:
        return binding
    return replace(binding, channels_first=True, notes=(*binding.notes, NOTE.format(names=", ".join(names))))




def with_dtype(binding: Binding, module) -> Binding:
    """``binding`` cast as a whole when ``module`` (built by it under the default dtype) holds floating weights of
    another dtype only: the class chose a dtype for itself, and the cases give their own."""
    if not isinstance(module, nn.Module):
        return binding
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    default = torch.get_default_dtype()
    if not dtypes or dtypes == {default} or binding.cast:
        return binding
    built = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    note = f"its weights are built in {built}: cast as a whole to the case's dtype before probing and checking"
    return replace(binding, cast=built, notes=(*binding.notes, note))


def bool_flags(binding: Binding) -> list[tuple[str, bool]]:
    """The constructor's unbound boolean parameters with a default: ``(name, default)``, candidates for a causal flag."""
    try:
        params = signature(binding.target).parameters.values()
    except (TypeError, ValueError):
        return []
    bound = {p for p, _ in binding.params} | {p for p, _ in binding.extras} | {p for p, _ in binding.causal_flags}
    return [(p.name, p.default) for p in params if isinstance(p.default, bool) and p.name not in bound
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def causal_by_flag(binding: Binding, is_causal) -> Binding | None:
    """``binding`` with a constructor flag that makes the class causal (its default does not): each unbound boolean
    flipped in turn, kept when ``is_causal(candidate)`` says the outputs became causal; None when no flag does."""
    if not inspect.isclass(binding.target):
        return None
    for name, default in bool_flags(binding):
        candidate = replace(binding, causal_flags=(*binding.causal_flags, (name, not default)),
                            notes=(*binding.notes, f"{name}: set to {not default} for causal attention and {default} "
                                                   "otherwise, decided by a probe (with its default the outputs are "
                                                   "not causal, flipped they are)"))
        try:
            if is_causal(candidate):
                return candidate
        except Exception:  # this flag breaks the class: not the one
            continue
    return None


def _bias_elements(binding: Binding, probe: AttnSpec) -> int:
    module = binding(probe)
    return sum(p.numel() for p in module.parameters() if p.dim() == 1) if isinstance(module, nn.Module) else -1


def bias_by_flag(binding: Binding, probe: AttnSpec) -> Binding:
    """``binding`` with an unbound boolean constructor flag given the spec's ``qkv_bias`` when its effect says it is
    the q/k/v bias switch, whatever its name (mamba's ``qkv_proj_bias``): built with it True, the class has exactly the
    query, key and value biases (``d_out + 2·kv_dim`` elements, or those and the output's) that it lacks with it False."""
    if binding.style != "keywords" or "qkv_bias" in binding.fields or not inspect.isclass(binding.target):
        return binding
    qkv = probe.d_out + 2 * probe.kv_dim
    for name, _ in bool_flags(binding):
        try:
            off, on = (_bias_elements(replace(binding, extras=(*binding.extras, (name, v))), probe) for v in (False, True))
        except Exception:  # this flag breaks the class at one value: not a bias switch
            continue
        if on - off in (qkv, qkv + probe.d_out):
            note = (f"{name}: the spec's qkv_bias, decided by a probe (built with {name}=True the class has the {on - off} "
                    f"bias elements of its {'q/k/v and output' if on - off > qkv else 'q/k/v'} projections that it lacks "
                    "with False)")
            return replace(binding, params=(*binding.params, (name, "qkv_bias")), notes=(*binding.notes, note))
    return binding


def theta_rotates(binding: Binding, probe: AttnSpec, bind=None) -> bool | None:
    """Does the class rotate at all, given the rotary base its constructor takes? It does when its output moves with the
    theta (built at 10,000 and at 100 with the same parameters: a class that rotates its queries only) or with the
    positions (the last of 4 tokens' output moves when the 3 before it are permuted: a class that rotates with a theta
    of its own, whose RoPE cases then fail). When neither, the theta builds nothing (mamba's ``MHA`` takes
    ``rotary_emb_base`` but rotates nothing with ``rotary_emb_dim=0``; lingua takes one beside the tables its forward
    is given, neutral here). None when the probe cannot run."""
    x = torch.randn(1, 4, probe.d_in, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    try:
        (at_base, permuted), params = _outputs(binding, probe, bind, 10000.0, None, (x, x[:, [2, 0, 1, 3]]))
        other = _outputs(binding, probe, bind, 100.0, params, (x,))[0][0]
    except Exception:  # does not run at the probe's sizes: the rope cases show what it does
        return None
    moved_by_theta = not torch.allclose(at_base, other, rtol=1e-9, atol=1e-12)
    return moved_by_theta or not torch.allclose(at_base[:, -1], permuted[:, -1], rtol=1e-9, atol=1e-12)


def _outputs(binding: Binding, probe: AttnSpec, bind, theta: float, params: dict | None, inputs) -> tuple[list, dict]:
    """The class built at ``theta`` (``params`` loaded, so that only what the theta builds differs) on each input, and
    the parameters it was run with."""
    torch.manual_seed(0)
    module = binding(replace(probe, rope_theta=theta)).double().eval()
    if params is not None:
        module.load_state_dict(params, strict=False)
    used = {n: p.detach().clone() for n, p in module.named_parameters()}
    module = bind(module, probe) if bind is not None else module  # the spec's tables, neutral: the class's own
    with torch.no_grad():
        outs = [module(t) for t in inputs]
    return [o[0] if isinstance(o, tuple) else o for o in outs], used


def ints_by_shape(binding: Binding, probe: AttnSpec) -> Binding:
    """``binding`` with unbound optional int constructor parameters given a role when their effect on the weights says
    which, whatever their names: the kv heads (mamba's ``num_heads_kv=None``: built with 2 for 4 heads, the class's
    weight matrices hold what grouped-query attention with 2 kv heads holds, which they do not as built), or the width
    of a second input (a cross-attention's ``context_dim=768``: built with d_in, they hold what self-attention holds)."""
    if binding.style != "keywords" or not inspect.isclass(binding.target):
        return binding
    try:
        params = signature(binding.target).parameters.values()
    except (TypeError, ValueError):
        return binding
    grouped = replace(probe, num_heads=4, num_kv_heads=2)
    tries = {"num_kv_heads": (grouped, 2, "with {p}=2 for 4 heads its weight matrices hold what grouped-query attention "
                                          "with 2 kv heads holds"),
             "d_context": (probe, probe.d_in, "with {p}=d_in its weight matrices hold what self-attention holds, and as "
                                              "built they do not: the width of its second input")}
    for p in params:
        taken = {n for n, _ in (*binding.params, *binding.extras, *binding.causal_flags)}
        if p.name in taken or isinstance(p.default, bool) or not (p.default is None or isinstance(p.default, int)):
            continue
        for role, (spec, value, why) in tries.items():
            if role in binding.fields:
                continue
            try:
                as_built, with_role = (_matrix_elements(b, spec) for b in (binding, replace(binding, extras=(
                    *binding.extras, (p.name, value)))))
            except Exception:  # this parameter breaks the class at this value: not this role
                continue
            if with_role == weight_elements(spec) != as_built:
                note = f"{p.name}: the spec's {role}, decided by a probe (built {why.format(p=p.name)})"
                binding = replace(binding, params=(*binding.params, (p.name, role)), notes=(*binding.notes, note))
                break
    return binding


def _matrix_elements(binding: Binding, spec: AttnSpec) -> int:
    return sum(p.numel() for p in binding(spec).parameters() if p.dim() >= 2)


def always_one_kv_head(binding: Binding, probe: AttnSpec) -> bool:
    """Is the class multi-query by construction (memorizing-transformers' ``to_kv = Linear(dim, 2 * dim_head)``)? With
    no constructor parameter for the kv heads, built for 4 heads its weight matrices hold what one key/value head
    for all 4 query heads holds, not what 4 heads hold."""
    if "num_kv_heads" in binding.fields or any(r == "num_kv_heads" for _, r in binding.params):
        return False
    spec = replace(probe, num_heads=4, num_kv_heads=None)
    try:
        built = _matrix_elements(binding, spec)
    except Exception:  # does not build at 4 heads: the cases show what it does
        return False
    return built == weight_elements(replace(spec, num_kv_heads=1)) != weight_elements(spec)
