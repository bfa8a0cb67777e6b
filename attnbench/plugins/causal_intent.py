"""A class meant to be causal, but that no mask form makes causal: checked, not refused (issue 47).

A planted merge that mixes tokens (``out.reshape(B, T, C)`` without the transpose) or a mask built with the wrong
diagonal makes a causal class non-causal under every mask form attnbench can give it, and binding used to refuse it
as "not causal with any mask form": its user learned nothing of where the bug is. What says a class is meant to be
causal is its own source:

its forward builds or asks for a causal mask (``tril``, ``triu``, ``is_causal``, ``causal``; not
``is_causal=False``), or its ``__init__`` does (GPT-NeoX's ``bias`` buffer), or it keeps a decoder's KV cache
(``cache_k``, ``start_pos``: round 17). A forward that only takes a mask its
caller makes says nothing: an encoder (a key-padding mask, dinov2's ``attn_bias`` ignored without xformers) is refused
as not causal with any mask form, its true cause. (Round 16 tried checking such classes too: on the development set
the two planted classes it reached were localised to wrong lines, and it turned true refusals into failures.)

Such a class is bound with its optional mask left at None, else with the form under which later tokens move earlier
outputs least (the right form leaves only the bug's leak; a wrong one adds unmasked attention to it), checked, and
its causal cases fail and are localised. ``-v`` says so.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from dataclasses import replace

import torch

INTENT = re.compile(r"\b(tril|triu|is_causal|causal\w*|LowerTriangular|cache_k|cache_v|k_cache|v_cache|start_pos|"
                    r"future_mask|subsequent_mask|look_ahead_mask)\b")
"""Words of a forward (or the helpers it names) that build or ask for a causal mask, or keep a decoder's KV cache
(Meta's Llama: ``self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk``, written for one token at a time), or
take a mask of the future by the names decoders give it (``future_mask``, the Annotated Transformer's
``subsequent_mask``)."""
NOT_CAUSAL = re.compile(r"\b\w*causal\w*\s*(=|==|:\s*bool\s*=)\s*False\b|\bnot\s+(self\.)?\w*causal")
"""What says the opposite: ``is_causal=False`` (an encoder's SDPA call), ``if not self.causal``."""


FLAG_ATTR = re.compile(r"\b\w*causal\w*\s*=\s*self\.(\w+)")
"""``is_causal=self.causal``: no intent when the class's own attribute is False (flux's encoder, ``causal = False``)."""


def intent(target) -> str:
    """Why ``target`` is meant to be causal: the first line of its forward (else of its ``__init__``, a causal mask
    buffer) that says so, as ``line N "text"``; or ``""``."""
    for method in ("forward", "__init__"):
        said = _first_saying(getattr(target, method, None), target)
        if said:
            return said
    for method in ("forward", "__init__"):  # a helper of its module they call (d3rlpy's create_attention_mask: tril)
        for helper in _helpers(target, getattr(target, method, None)):
            said = _first_saying(helper)
            if said:
                return f"{said} (in {helper.__name__}, which its {method} calls)"
    name = getattr(target, "__name__", "")
    return f"its name {name!r}" if re.search(r"(?<!non)(?<!never)(?<!not)(?<!un)(?<!non_)causal", name, re.I) else ""


def _helpers(target, function) -> list:
    """The functions of ``target``'s module that ``function`` calls by name."""
    module = sys.modules.get(getattr(target, "__module__", "") or "")
    try:
        text = inspect.getsource(function) if module is not None else ""
    except (OSError, TypeError):
        return []
    called = dict.fromkeys(re.findall(r"(?<![\w.])([A-Za-z_]\w*)\s*\(", text))
    return [f for name in called if inspect.isfunction(f := getattr(module, name, None))]


def _first_saying(function, target=None) -> str:
    try:
        lines, start = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return ""
    for i, line in enumerate(lines):
        code = NOT_CAUSAL.sub("", line.split("#", 1)[0])
        code = FLAG_ATTR.sub(lambda m: "" if getattr(target, m.group(1), None) is False else m.group(0), code)
        if INTENT.search(code) and not code.strip().startswith(("def ", '"', "'")):
            return f"line {start + i} {code.strip()[:60]!r}"
    return ""


def leak(build, plan, spec, bind) -> float | None:
    """How much changing the last of 5 tokens moves the earlier outputs, relative to the outputs; None when the class
    does not run so."""
    try:
        module = bind(build(spec).eval(), plan, spec)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 5, spec.d_in, generator=g)
        y = x.clone()
        y[:, -1] += torch.randn(spec.d_in, generator=g)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a, b = module(x), module(y)
    except Exception:  # noqa: BLE001 - this form does not run: not a candidate
        return None
    a, b = (t[0] if isinstance(t, tuple | list) else t for t in (a, b))
    if not isinstance(a, torch.Tensor) or a.shape[:2] != (2, 5) or not torch.isfinite(a).all():
        return None
    return float((a - b)[:, :-1].abs().max() / a.abs().max().clamp_min(1e-6))


def least_leaking(build, candidates, spec, bind, why: str):
    """The candidate plan (in order; ties keep the first) under which later tokens move earlier outputs least, marked
    with ``why``; None when none runs."""
    best = None
    for plan in candidates:
        found = leak(build, plan, spec, bind)
        if found is not None and (best is None or found < 0.5 * best[0]):
            best = (found, plan)
    return None if best is None else replace(best[1], leaky=why)
