"""``attnbench adapt FILE:Class``: an adapter file for a class attnbench cannot bind by itself.

The adapter is a short Python file the user owns. It imports the class unchanged, builds it from an
:class:`~attnbench.spec.AttnSpec` with every argument attnbench solved written out (``d_model=spec.d_in``), and marks
each argument it could not solve with ``TODO("...")``, which raises when the class is built, so that ``attnbench check``
names it until it is completed. **The adapter protocol**: a class whose constructor takes one parameter named ``spec``
(an ``AttnSpec``) is built as ``Class(spec)``; its ``forward(x, ...)`` takes the input and, by the names attnbench
supplies (``mask``, ``cos``/``sin``, ``start_pos``, ``kv_cache``, ...: docs/own-attention.md), any context, and returns
``(B, T, d_out)``, causal when ``spec.causal``. Weights are found inside it as in any class.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from pathlib import Path

from attnbench.errors import PluginLoadError
from attnbench.plugins import forms, signatures
from attnbench.plugins.binding import _BY_NAME, CONFIG_NAMES, INDEX_NAMES, RESIDUAL_DROPOUT, bind
from attnbench.plugins.context import CACHE_NAMES, CAUSAL_ARGS, MASK_NAMES, POSITION_NAMES, TABLE_NAMES
from attnbench.plugins.roles import guess

SPEC_EXPR = {"d_in": "spec.d_in", "d_out": "spec.d_out", "num_heads": "spec.num_heads",
             "num_kv_heads": "spec.num_kv_heads or spec.num_heads", "head_dim": "spec.head_dim",
             "context_length": "spec.context_length", "dropout": "spec.dropout", "qkv_bias": "spec.qkv_bias",
             "causal": "spec.causal", "window": "spec.window", "rope_theta": "spec.rope_theta",
             "residual_dropout": "0.0", "d_context": "spec.d_in"}
"""How the adapter writes each role as an expression of ``spec``."""
MAYBE_NONE = {"rope_theta": "a spec without RoPE has no theta"}
"""Spec fields that are ``None`` for some specs: a parameter the class requires gets them only when they are set."""
SUPPLIED = set(MASK_NAMES) | set(TABLE_NAMES) | set(POSITION_NAMES) | set(CACHE_NAMES) | set(CAUSAL_ARGS) | \
    {"use_cache"}

TEMPLATE = '''"""Adapter for {cls} ({where}), written by `attnbench adapt`.

{why}
Complete each TODO below (an expression of `spec`, an attnbench.AttnSpec: spec.d_in, spec.num_heads,
spec.num_kv_heads, spec.head_dim, spec.context_length, spec.dropout, spec.qkv_bias, spec.causal, ...), then run:

    attnbench check {out}:Adapted
"""

from pathlib import Path

from torch import nn

from attnbench.plugins.loading import import_file

Target = import_file(str(Path(__file__).parent / {rel!r})).{cls}


def TODO(what: str):
    raise NotImplementedError(f"adapter TODO: {{what}} (complete it in {{__file__}})")


class Adapted(nn.Module):
    """{cls} built from an AttnSpec (attnbench's adapter protocol: a constructor taking `spec`)."""
{caps}

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.inner = Target(
{ctor}
        ){post}

    def forward(self, {fsig}):
        return self.inner({fcall})
'''


def _ctor_lines(target) -> list[str]:
    """One ``name=expression,  # how`` line per constructor parameter attnbench fills or cannot fill."""
    try:
        binding = bind(target)
        solved = dict(binding.params)
    except PluginLoadError:
        solved = {}
    lines = []
    for p in list(signatures.signature(target).parameters.values()):
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        field = solved.get(p.name) or _BY_NAME.get(p.name) or ("residual_dropout" if p.name in RESIDUAL_DROPOUT else None)
        if field == "window" and p.default is p.empty:  # required: a window over every position when there is none
            lines.append(f"{p.name}=spec.window if spec.window is not None else spec.context_length,  # by its name")
        elif field in MAYBE_NONE and p.default is p.empty:  # required, and None for some specs: it needs a value
            what = f"{p.name}: the class requires it and {MAYBE_NONE[field]}; give the value that makes it that"
            lines.append(f"{p.name}={SPEC_EXPR[field]} if {SPEC_EXPR[field]} is not None else TODO({what!r}),")
        elif field in SPEC_EXPR:
            lines.append(f"{p.name}={SPEC_EXPR[field]},  # by its name")
        elif p.name in INDEX_NAMES and p.default is p.empty:
            lines.append(f"{p.name}=0,  # one layer: index 0")
        elif p.name in CONFIG_NAMES and p.default is p.empty:
            lines.append(f"{p.name}=SpecConfig.for_spec(spec),  # every alias of every field; or build the class's own")
        elif p.default is p.empty and guess(p, set(solved.values())) in SPEC_EXPR:
            lines.append(f"{p.name}={SPEC_EXPR[guess(p, set(solved.values()))]},  # from its name: no probe could build "
                         "the class without the TODOs; check it")
        elif p.default is p.empty:
            lines.append(f"{p.name}=TODO({_todo_text(p)!r}),")
    return [" " * 12 + line for line in lines]


def _todo_text(p: inspect.Parameter) -> str:
    ann = "" if p.annotation is p.empty else f" ({getattr(p.annotation, '__name__', p.annotation)})"
    return f"{p.name}{ann}: what {p.name} must be for this spec (attnbench found no role for it)"


def _forward_parts(target, plan) -> tuple[str, str]:
    """The adapter's ``forward`` signature (``x`` and every argument attnbench supplies, as the class declares them) and
    the inner call: those passed through, each other required one as the probes gave it (``plan``: ``x`` again, None),
    else a TODO."""
    try:
        params = list(signatures.signature(target.forward).parameters.values())[1:]
    except (TypeError, ValueError, AttributeError):
        return "x", "x"
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not named:
        return "x", "x"
    sig, call = [named[0].name], [named[0].name]
    probed = {**dict.fromkeys(plan.inputs, named[0].name), **dict.fromkeys(plan.nones, "None")} if plan else {}
    passed = ({plan.position, *plan.tables} if plan else set()) | SUPPLIED
    for p in named[1:]:
        if p.name in passed:
            sig.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
            call.append(f"{p.name}={p.name}")
        elif p.name in probed:  # as the causal probe gave it: the same sequence again, or None
            call.append(f"{p.name}={probed[p.name]}")
        elif p.default is p.empty:
            what = f"{p.name}: a forward argument attnbench does not supply; build it from {named[0].name} and self.spec"
            call.append(f"{p.name}=TODO({what!r})")
    return ", ".join(sig), ", ".join(call)


def _probed(target):
    """``(plan, form)``: the class's forward context as the probes decide it, and what its forward takes and does
    before its projections (:mod:`~attnbench.plugins.forms`); None for what cannot be probed (the class does not build
    without its TODOs, or no form of its context is causal)."""
    from attnbench.plugins.inference import plan_with_probe

    try:
        binding = bind(target)
        plan = plan_with_probe(target, binding)
    except Exception:  # not buildable or not causal as it is: the adapter's TODOs say what is missing
        return None, None
    return plan, forms.probe_class(binding, plan, binding.probe, contextlib.nullcontext())


def _form_parts(form, fcall: str) -> tuple[str, str]:
    """The line after the class is built and the inner call, for what its forward takes and does first: its pre-norm
    replaced by ``nn.Identity()``, images a TODO."""
    if form and form.norm:
        return (f"\n        self.inner.{form.norm} = nn.Identity()  # a pre-norm (measured): the attention without it",
                fcall)
    if form:
        what = f"x is (B, T, C) tokens; {form.headline.split(':')[0]}: reshape x and the output"
        return "", f"TODO({what!r})"
    return "", fcall


def _capabilities(ctor: list[str]) -> str:
    """The adapter's ``attnbench_capabilities`` line: what the constructor lines it wrote do not pass on."""
    uses = "\n".join(ctor)
    caps = {"same_width_only": "spec.d_in" in uses and "spec.d_out" not in uses,  # one width: d_in == d_out
            "qkv_bias": False if "spec.qkv_bias" not in uses else None,  # nothing passes the bias flag: no q/k/v bias
            "dropout": () if "spec.dropout" not in uses else None}  # nothing passes the rate: no attention dropout
    shown = ", ".join(f"{k!r}: {v!r}" for k, v in caps.items() if v not in (None, False) or k == "qkv_bias" and v is False)
    return f"\n    attnbench_capabilities = {{{shown}}}  # what the constructor below does not take; edit to match" \
        if shown else ""


def write_adapter(path_text: str, cls_name: str, target, out: Path, why: str) -> Path:
    """Write the adapter for ``target`` (class ``cls_name`` in ``path_text``) to ``out``; returns ``out``."""
    ctor = _ctor_lines(target)
    plan, form = _probed(target)
    fsig, fcall = _forward_parts(target, plan)
    post, fcall = _form_parts(form, fcall)
    why = f"attnbench refused the class as it is:\n    {cls_name} {form.headline}" if form else why
    rel = os.path.relpath(Path(path_text).expanduser().resolve(), out.resolve().parent)
    caps = _capabilities(ctor)
    text = TEMPLATE.format(cls=cls_name, where=path_text, why=why, out=out.name, rel=rel, caps=caps, post=post,
                           ctor="\n".join(ctor) if ctor else " " * 12 + "# no argument", fsig=fsig, fcall=fcall)
    if "SpecConfig" in text:
        text = text.replace("from attnbench.plugins.loading import import_file\n",
                            "from attnbench.plugins.binding import SpecConfig\nfrom attnbench.plugins.loading import "
                            "import_file\n")
    out.write_text(text)
    return out
