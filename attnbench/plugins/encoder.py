"""An encoder's attention: a class that is not causal, and is not meant to be, checked against the non-causal reference.

ViT's, BERT's, a speech or diffusion model's attention lets every token attend to every token. Such a class was checked
as if it were causal, and FAILed every case ("likely cause: no causal mask"), or, when it takes a padding mask, was
refused as "not causal with any mask form". A class is an encoder's when

1. with its optional mask left at ``None`` it runs, and its output at the first position moves when only the last
   token changes (it sees later tokens), and
2. nothing in its source says it is meant to be causal (:func:`~attnbench.plugins.causal_intent.intent`: ``tril``,
   ``is_causal``, a causal name, a decoder's cache), and no constructor parameter is a context length (a decoder's
   mask or cache size: the book's ``(d_in, d_out, context_length, dropout, num_heads)``).

Then ``own["encoder"]``: every case runs at its spec with ``causal=False`` (the class's own constraint, as RoPE a class
always applies), the causality case is skipped, and ``-v`` says so. A causal class whose mask a bug removed keeps its
intent (its ``tril`` buffer, its ``is_causal``) and fails; one with no trace of causality left passes as an encoder,
and its ``PASS`` line says "non-causal".
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnbench.plugins.causal_intent import intent
from attnbench.plugins.exits import plugin_exits


def sees_later_tokens(build, probe, bind=None) -> bool | None:
    """Does the first position's output move when only the last of five tokens changes? ``None`` when it does not run."""
    try:
        module = build(replace(probe, window=None, causal=False)).eval()
        module = bind(module) if bind is not None else module
        g = torch.Generator().manual_seed(46)
        x = torch.randn(1, 5, probe.d_in, generator=g)
        other = x.clone()
        other[:, -1] += torch.randn(probe.d_in, generator=g)
        with torch.no_grad():
            a, b = (module(t) for t in (x, other))
    except Exception:  # noqa: BLE001 - it does not run on the probe: not decided here
        return None
    a, b = (t[0] if isinstance(t, tuple | list) else t for t in (a, b))
    if not isinstance(a, torch.Tensor) or a.dim() < 2:
        return None
    return bool((a[:, 0] - b[:, 0]).abs().max() > 1e-6 * a.abs().max())


def is_encoder(build, probe, bind=None, sized: bool = False) -> bool:
    """An encoder's attention: it sees later tokens, nothing of its source says it is meant to be causal, and it is
    not ``sized`` by a context length (a decoder's, sizing its mask or cache: the book's signature)."""
    if sized or intent(getattr(build, "target", None)):
        return False
    with plugin_exits("a probe of its forward"):  # sys.exit or os._exit in its forward: not decided here
        return sees_later_tokens(build, probe, bind) is True


def sized(binding) -> bool:
    """Is the class sized by a context length (a decoder's mask or cache): a constructor parameter of that role, or a
    config field of one of its names that the constructor reads on a probe?"""
    from attnbench.plugins.aliases import ALIASES
    from attnbench.plugins.config_reads import config_fields_read

    if binding.style == "config":
        read = config_fields_read(binding)
        return read is not None and any(n in read for n in ALIASES["context_length"])
    return "context_length" in binding.fields


LINE = ("causal: no, an encoder's attention (decided by a probe: with no mask the first output moves when the last "
        "token changes, nothing in its source builds or asks for a causal mask, and it takes no context length): "
        "every case runs non-causal, and the causality case is skipped")
"""The ``check -v`` line."""
