"""A constructor flag that switches the score scale on, set by the scale it causes, not by its name (issue 46).

OpenAI's GPT-2 ``Attention(nx, n_ctx, config, scale=False)`` (and the ports of it: Hugging Face's ``GPT2Attention``'s
``scale_attn_weights``, jukebox, many GPT-2 re-implementations) scales its scores by ``1/sqrt(head_dim)`` only when
a boolean says so, and the model that uses it always passes ``scale=True``. Built with its defaults, such a class
computes unscaled scores and fails every case for a reason that is not a bug of its own.

The scale a class applies is measured on :data:`~attnbench.plugins.measured.PROBE` with weights attnbench chose
(``W_v = W_o = I``, ``W_q = W_k = A``): a zero token (key 0, score 0, value 0) then a token ``x1``, which attends to
the zero token and to itself with score ``s * |q_h|^2`` per head; its output is ``p_h * v_h`` with ``p_h`` the
sigmoid of that score, so ``s = logit(p_h) / |q_h|^2``. When the class as built does not scale by
``1/sqrt(head_dim)`` and flipping exactly one of its unbound boolean constructor flags makes it do so, that flag is
set, and ``check -v`` says which and why. A class no flag brings to the reference's scale is left as built: its cases
show what it does (``likely cause: scores not scaled``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import torch

from attnbench.plugins.measured import PROBE, _heads, _Probe, _weights

RELATIVE = 1e-6
"""A measured scale within this (relative) of the reference's is the reference's."""


def measured_scale(factory) -> float | None:
    """The score scale ``s`` the class applies (one for every head), or ``None`` when the probe cannot read one."""
    g = torch.Generator().manual_seed(46)
    try:
        probe = _Probe(factory, PROBE)
        a = torch.randn(PROBE.d_out, PROBE.d_in, generator=g, dtype=torch.float64) / math.sqrt(PROBE.d_in)
        x1 = torch.randn(PROBE.d_in, generator=g, dtype=torch.float64) * 0.5
        x = torch.zeros(1, 2, PROBE.d_in, dtype=torch.float64)
        x[0, 1] = x1
        y = _heads(probe.run(_weights(a, a.clone()), x)[0, 1])
    except Exception:  # does not build or run on the probe: nothing measured
        return None
    v, q = _heads(x1), _heads(a @ x1)
    p = (y * v).sum(-1) / (v * v).sum(-1)
    if not ((y - p[:, None] * v).abs().max() <= 1e-6 * y.abs().max() and ((p > 0) & (p < 1)).all()):
        return None  # not a mix of the two values (a norm, a bias, another layout): not this probe's to read
    scales = torch.log(p / (1 - p)) / q.pow(2).sum(-1)
    if (scales - scales.mean()).abs().max() > RELATIVE * scales.abs().mean():
        return None
    return float(scales.mean())


def scale_by_flag(binding, make_factory, factory) -> tuple[object, object, str | None]:
    """``(binding, factory, note)``: with the one unbound boolean flag flipped whose other value brings the measured
    score scale to ``1/sqrt(head_dim)`` when the class as built scales by nothing; as given (note None) otherwise."""
    from attnbench.plugins.stages import bool_flags

    want = 1 / math.sqrt(PROBE.head_dim)
    flags = bool_flags(binding) if inspect.isclass(binding.target) and binding.style == "keywords" else []
    if not flags:
        return binding, factory, None
    built = measured_scale(factory)
    if built is None or abs(built / want - 1) <= RELATIVE or abs(built - 1) > RELATIVE:
        return binding, factory, None  # a flag that switches the scale on: as built, unscaled (a planted second
        # scale under UER's with_scale=True, 1/head_dim as built, must fail, not be switched off)
    for name, default in flags:
        candidate = replace(binding, extras=(*binding.extras, (name, not default)))
        try:
            flipped = make_factory(candidate)
        except Exception:  # this flag breaks the class: not the one
            continue
        got = measured_scale(flipped)
        if got is not None and abs(got / want - 1) <= RELATIVE:
            note = (f"{name}: set to {not default}, decided by a probe (as built, {name}={default}, its scores are "
                    f"scaled by {built:.4g}; with {name}={not default} by {got:.4g} = 1/sqrt(head_dim), the reference's)")
            return replace(candidate, notes=(*candidate.notes, note)), flipped, note
    return binding, factory, None
