"""Replaying a failing case's forward under a recorder, with the reference's stages for the same inputs (issue 47).

The class is built again exactly as the case built it (same weights, inputs, dtype and seed; built with gradients on,
since a build may probe them) and its forward runs once under a :class:`~attnbench.correctness.localize_record.
Recorder`. The float64 reference of the same rounded inputs and weights gives the stages. An ``extreme_logits`` case
is replayed with the weights it stresses the class with (scores at +20 in float16: an overflow the plain inputs never
reach), once per stress. When the class turns its RoPE pairs by -theta as measured (the reference follows it), the
stages at the default +theta come too: a class that turns q and k opposite ways matches each direction on one side
(:mod:`~attnbench.correctness.localize_rope`). A forward that raises in a torch call of the class's code keeps where
(:class:`~attnbench.correctness.localize_record.Failure`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch

from attnbench.correctness.localize_record import Failure, Record, Recorder, ReturnLines, module_tensors
from attnbench.correctness.stages import Stage, capture, staged


@dataclass
class Replay:
    """One replayed forward: its ``records``, the reference's ``stages``, ``backward`` (``None`` unless replayed for
    gradients: the class's output, the output gradient, the reference stages' gradients), the index of the record
    the forward returned, the stages at +theta (``None`` unless the reference turns by the class's measured
    -theta), and the call that raised (``failure``) or any other exception of the replay (``error``)."""

    records: list[Record]
    stages: list[Stage]
    backward: tuple | None = None
    returned: int | None = None
    plus_theta: list[Stage] | None = None
    failure: Failure | None = None
    error: Exception | None = None
    returned_at: tuple[str, int, str] | None = None  # the class's return statement that returned it
    conventions: list[tuple[str, list[Stage]]] = field(default_factory=list)  # the stages in the other RoPE forms
    made: tuple | None = None  # (the recorder's aux tensors, its records' other arguments, buffer id -> name, module)


def replays(impl, case, device: str = "cpu", seed: int = 0, grad: bool = False) -> list[Replay]:
    """The case's forward replayed (one :class:`Replay`; an ``extreme_logits`` case: one per stress)."""
    from attnbench.correctness.basic import build_for
    from attnbench.correctness.cases import SEED
    from attnbench.correctness.matrix import multi_query_case
    from attnbench.plugins.exits import plugin_exits

    case = multi_query_case(impl, case)  # as the case ran it
    token = SEED.set(seed)
    try:
        with warnings.catch_warnings(), plugin_exits(impl.name):
            warnings.simplefilter("ignore")
            built = build_for(impl, case, torch.device(device))  # with gradients on: a build may probe them
        return [_replay(impl, load(), x, case.dtype, device, grad) for load, x in _inputs(built, case)]
    finally:
        SEED.reset(token)


def _inputs(built, case) -> list[tuple]:
    """``(loader, float64 input)`` pairs the case ran: its input, or for ``extreme_logits`` each stressed pair (the
    loader loads the stressed weights into the module, so each is called just before its replay)."""
    from attnbench.correctness.cases import inputs, seed_for
    from attnbench.weights import random_weights

    x = inputs(case.shape)
    if case.kind != "extreme_logits":
        return [(lambda: built, x)]
    from attnbench.correctness import properties

    w = built.zeroed(random_weights(case.shape.spec, seed=seed_for(case.shape)))
    target = properties.EXTREME_LOGIT[case.dtype]
    out = []
    for kind in ("overflow", "underflow"):
        w_x, x_x = properties._extreme_weights(x, w, case.shape.spec.num_heads, target, kind)
        out.append((lambda w_x=w_x: built.reload(w_x), x_x))
    return out


def _replay(impl, built, x, dtype: str, device: str, grad: bool) -> Replay:
    """The forward of ``built`` on ``x`` (rounded to ``dtype``) under a recorder, and the reference's stages."""
    from attnbench.correctness.cases import reference
    from attnbench.correctness.localize_grad import reference_grads
    from attnbench.devices import DTYPES
    from attnbench.plugins.exits import plugin_exits

    x_low = x.to(DTYPES[dtype])
    x_dev = x_low.to(device).requires_grad_(grad)
    rec = Recorder([x_dev], keep_live=grad)
    w64 = built.weights.to(dtype=torch.float64)
    with warnings.catch_warnings(), plugin_exits(impl.name), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        x64 = x_low.to(torch.float64).requires_grad_(grad)
        with capture(live=grad) as notes:
            ref_out = reference(x64, w64, built.spec)
        plus = _plus_theta(x64.detach(), w64, built.spec)
        others = _conventions(x64.detach(), w64, built.spec)
        lines = ReturnLines()
        try:
            with rec, lines:
                out = built.module(x_dev)
        except Exception as exc:  # the class raised: where, when in a torch call of its own code
            return Replay(rec.records, _detached(notes, built.spec), plus_theta=plus, failure=rec.failure, error=exc,
                          conventions=others)
        backward = None
        if grad:
            g = torch.randn(*ref_out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            backward = out, g.to(device=out.device, dtype=out.dtype), reference_grads(notes, ref_out, g)
    buffers = module_tensors(built.module)
    return Replay(rec.records, _detached(notes, built.spec), backward, rec.index_of(out), plus,
                  returned_at=lines.line_of(out), conventions=others,
                  made=(rec.aux, rec.arg_ids, buffers, built.module))


def _detached(notes: dict, spec) -> list[Stage]:
    notes = {k: ({h: t.detach() for h, t in v.items()} if isinstance(v, dict) else v.detach()) for k, v in notes.items()}
    return staged(notes, spec)


def _plus_theta(x64: torch.Tensor, w64, spec) -> list[Stage] | None:
    """The stages with pairs turned by +theta, when the reference turns them by the class's measured -theta."""
    from attnbench.correctness.cases import reference

    if getattr(spec, "rope_sign", 1) != -1 or spec.rope_theta is None:
        return None
    plus = replace(spec, rope_sign=1)
    with torch.no_grad(), capture() as notes:
        reference(x64, w64, plus)
    return staged(notes, plus)


def _conventions(x64: torch.Tensor, w64, spec) -> list[tuple[str, list[Stage]]]:
    """The reference's stages in each RoPE form other than the measured one (pairs half or interleaved, turned by
    +theta or -theta), named; none without RoPE. A bug in a class's rotation can make the probes read the wrong
    form (:func:`~attnbench.correctness.localize_rope.other_form`)."""
    from attnbench.correctness.cases import reference
    from attnbench.spec import ROPE_STYLES

    if spec.rope_theta is None or spec.kv_lora_rank is not None:  # MLA has no staged reference
        return []
    out = []
    for style in ROPE_STYLES:
        for sign in (1, -1):
            if (style, sign) == (spec.rope_style, getattr(spec, "rope_sign", 1)):
                continue
            alt = replace(spec, rope_style=style, rope_sign=sign)
            with torch.no_grad(), capture() as notes:
                reference(x64, w64, alt)
            out.append((f"{style} pairs turned by {'+' if sign == 1 else '-'}theta", staged(notes, alt)))
    return out
