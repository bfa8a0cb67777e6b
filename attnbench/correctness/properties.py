"""Round-2 properties of the correctness matrix: what plain forward/backward cases on small shapes miss.

Each property is one case kind (its name is what a failure row shows) and runs several checks on one
module build; a failure message names the smallest failing sub-case (the shortest ``T``, the first
call, the first input layout):

* ``extreme_logits``: weights scaled until the scores reach about +-100 (float32) or +-20 (float16,
  bfloat16); outputs must stay finite and equal the reference (a softmax without max subtraction
  overflows).
* ``long_seq``: ``T`` above 64, 128 and 256 and off every power of two (65, 129, 257, ...), up to
  ``T == context_length``, plus a backward at the longest ``T`` (tiled, wrapped or wrongly sized mask
  buffers, dropped partial tiles).
* ``dropout_mean``: in train mode the mean over many fixed seeds converges to the eval output
  (inverted dropout scales kept weights by ``1/(1-p)``), judged by a t-test with a stated false-alarm rate.
* ``strided_input``: transposed, sliced, strided, expanded and sequence-first views of ``x`` (and a
  transposed ``grad_output``) give the output and gradients of their contiguous copy; refusing them is a
  failure that says why.
* ``no_side_effects``: the input and every parameter are bit-identical after an eval forward, a
  train forward and a backward.
* ``shape_sequence``: one module called with different batch sizes and lengths, in a mixed order and
  through one reused input buffer, matches the reference at every call (no state keyed on the first shape).
* ``low_precision``: float16/bfloat16 at ``T >= 256`` is judged against the float64 reference
  *relative to* the harness's own math path run in the same dtype, which catches accumulation in the
  input dtype that a fixed loose tolerance at short ``T`` lets through.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from scipy import stats
from torch.nn import functional as F

from attnbench.correctness.basic import run_backward
from attnbench.correctness.cases import (
    Built,
    Case,
    CaseResult,
    Shape,
    build,
    composed,
    exc_line,
    inputs,
    rel_error,
    row,
    seed_for,
    tolerance,
)
from attnbench.correctness.reference import reference_forward
from attnbench.devices import DTYPES
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights, random_weights

EXTREME_SHAPE = Shape("extreme", 2, 24, AttnSpec(16, 16, 24, 0.0, 2, True))
EXTREME_LOGIT = {"float32": 100.0, "float16": 20.0, "bfloat16": 20.0}
"""The largest |score| (after the 1/sqrt(head_dim) scale) the extreme-logit case drives the weights to:
exp(+100) overflows float32 and exp(+20) float16; exp(-18) underflows float16 to 0."""

LONG_SHAPES = {  # shape -> the lengths run on one module, shortest first; seq_len is the longest
    "long_T257": (Shape("long_T257", 1, 257, AttnSpec(16, 16, 257, 0.0, 2)), (65, 96, 129, 200, 256, 257)),
    "long_T130": (Shape("long_T130", 2, 129, AttnSpec(8, 8, 130, 0.0, 4, True)), (100, 129)),
}
"""``T == context_length`` (257) and ``T == context_length - 1`` (129); 65, 129, 257 sit one past a
power of two, 96 is a multiple of 32 but not 64, 100 and 200 are multiples of none of 16/32/64/128."""

DROPOUT_SHAPE = Shape("dropout_p0.2", 3, 11, AttnSpec(24, 24, 11, 0.0, 3, True))
DROPOUT_P = 0.2  # not 0.5: there, keeping with probability p or scaling by 1/p looks right
DROPOUT_CALLS, DROPOUT_REPLICAS = 32, 16
DROPOUT_FALSE_ALARM = 1e-6
"""Chance that a correct implementation fails ``dropout_mean`` for a given seed.

Each of ``DROPOUT_CALLS`` train-mode calls (own fixed seed) sees the input repeated ``DROPOUT_REPLICAS``
times along the batch; the replicas' mean is one sample per output element. Every element gets a
one-sample t-test of "sample mean == eval output" (``DROPOUT_CALLS - 1`` degrees of freedom); the
threshold splits ``DROPOUT_FALSE_ALARM`` over all elements (Bonferroni, valid for correlated
elements), so P(false alarm) <= 1e-6 as far as the per-call means are normal (each averages 16
replicas of a sum over keys). Averaging whole calls, not replicas, keeps the test valid for an
implementation that shares one dropout mask across the batch.
"""

STRIDED_SHAPE = Shape("strided", 3, 10, AttnSpec(16, 16, 12, 0.0, 2, True))
SIDE_EFFECT_SHAPE = Shape("side_effects", 2, 9, AttnSpec(16, 16, 12, 0.0, 2, True))
SEQUENCE_SHAPE = Shape("sequence", 3, 40, AttnSpec(16, 16, 40, 0.0, 2, True))
SEQUENCE = ((2, 9), (2, 9), (1, 33), (3, 4), (3, 9), (1, 1), (3, 40), (2, 17), (1, 9), (2, 33))
"""(batch, T) of successive eval calls on one module: T up and down, each T again with another batch;
the second call reuses the first call's input tensor with new values (same shape, same data pointer)."""

LOW_PRECISION_SHAPE = Shape("lowp_T1000", 1, 1000, AttnSpec(32, 32, 1000, 0.0, 2))
"""Long enough that summing over keys in the input dtype costs several times the rounding of a float32 sum."""
RMS_FACTOR, MAX_FACTOR = 2.0, 8.0
"""Extreme-logit and low-precision outputs may have up to RMS_FACTOR times the RMS error (relative to the
reference's Frobenius norm) and MAX_FACTOR times the max error (relative to its largest entry) of the
harness's own math path
(``reference_forward`` run in the case's dtype on the same device); the RMS error is the stable
measure (correct built-ins stay within about 1.1x of the math path), the max error catches bugs
confined to a few outputs."""
BASELINE_FLOOR = {"float32": 1e-5, "float16": 5e-4, "bfloat16": 4e-3}
"""Errors below this always pass (about one unit roundoff for float16/bfloat16; the float32 forward tolerance)."""


def cases() -> list[Case]:
    """The property cases, in the order they run."""
    out = [Case("extreme_logits", EXTREME_SHAPE, dtype) for dtype in EXTREME_LOGIT]
    out += [Case("long_seq", shape, "float32") for shape, _ in LONG_SHAPES.values()]
    out += [Case("dropout_mean", DROPOUT_SHAPE, "float32"), Case("strided_input", STRIDED_SHAPE, "float64"),
            Case("no_side_effects", SIDE_EFFECT_SHAPE, "float32"), Case("shape_sequence", SEQUENCE_SHAPE, "float64")]
    out += [Case("low_precision", LOW_PRECISION_SHAPE, dtype) for dtype in ("bfloat16", "float16")]
    return out


_row, _exc_line = row, exc_line


def _weights_and_input(case: Case) -> tuple[CanonicalWeights, torch.Tensor]:
    """The case's seeded canonical weights and float64 input (both follow the run's seed)."""
    return random_weights(case.shape.spec, seed=seed_for(case.shape)), inputs(case.shape)


def _build(impl, case: Case, device: torch.device, w: CanonicalWeights, spec: AttnSpec | None = None) -> Built:
    """The module under test with ``w`` and the weights its reference uses (:func:`attnbench.correctness.cases.build`)."""
    return build(impl, spec or case.shape.spec, device, case.dtype, w)


# --- judged relative to the harness's own math path -----------------------------------------------

def _logits(x: torch.Tensor, w: CanonicalWeights, num_heads: int) -> torch.Tensor:
    """``q.k / sqrt(head_dim)`` as ``(b, nh, T, T)``, with -inf above the diagonal (the causal mask)."""
    b, T, _ = x.shape
    q = F.linear(x, w.W_q, w.b_q).view(b, T, num_heads, -1)  # (b, T, nh, hd)
    k = F.linear(x, w.W_k, w.b_k).view(b, T, num_heads, -1)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])  # (b, nh, T, T)
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)


def _scaled(t: torch.Tensor | None, f: float) -> torch.Tensor | None:
    return None if t is None else t * f


def _extreme_weights(x: torch.Tensor, w: CanonicalWeights, num_heads: int, target: float,
                     kind: str) -> tuple[CanonicalWeights, torch.Tensor]:
    """``(w, x)`` changed so the scores reach ``target``; ``w`` holds only what the module has (no bias it lacks).

    ``overflow``: q and k scaled until the largest score is ``+target`` (``x`` unchanged). ``underflow``:
    scores spread over +-``target``/20, then in each head every score of row ``i`` is shifted by ``q_i . u``
    (softmax ignores it): the row with the longest query is pushed to [-target, -0.9 target] and no score
    leaves +-target. The shift is a key bias carried by the input, so it works on layers without biases:
    every token gets the same component along a unit direction ``e`` (``x -> x P + e``, ``P = I - e e^T``),
    ``W_q`` and ``W_k`` ignore that component (``W P``), and a rank-one term ``u e^T`` of ``W_k`` turns it
    into the same key offset ``u`` for every token.
    """
    if kind == "underflow":
        d_in = x.shape[-1]
        e = torch.randn(d_in, generator=torch.Generator().manual_seed(d_in), dtype=x.dtype)
        e = e / e.norm()  # (d_in,)
        P = torch.eye(d_in, dtype=x.dtype) - torch.outer(e, e)  # (d_in, d_in), symmetric
        x = x @ P + e  # every token's component along e is exactly 1
        w = replace(w, W_q=w.W_q @ P, W_k=w.W_k @ P)
    scores = _logits(x, w, num_heads)
    allowed = scores.isfinite()
    top, bottom = float(scores[allowed].max()), float(scores[allowed].min())
    spread = target if kind == "overflow" else target / 20
    f = math.sqrt(spread / max(top, -bottom))
    sign = 1.0 if kind == "underflow" or top >= -bottom else -1.0  # overflow wants the +target side
    w = replace(w, W_q=w.W_q * f * sign, b_q=_scaled(w.b_q, f * sign), W_k=w.W_k * f, b_k=_scaled(w.b_k, f))
    if kind == "overflow":
        return w, x
    b, T, _ = x.shape
    q = F.linear(x, w.W_q, w.b_q).view(b * T, num_heads, -1)  # (b*T, nh, hd)
    hd = q.shape[-1]
    shift = torch.zeros_like(w.W_k[:, 0])  # (d_out,): the key offset of every token
    for h in range(num_heads):
        longest = q[q[:, h].norm(dim=-1).argmax(), h]  # (hd,)
        u = -longest / longest.norm()  # row shift q_i . u: most negative for the longest query, |.| <= that elsewhere
        shift[h * hd:(h + 1) * hd] = u * (0.95 * target * math.sqrt(hd) / float(longest.norm()))
    return replace(w, W_k=w.W_k + torch.outer(shift, e)), x


def _rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius) in float64; ``inf`` for non-finite or mis-shaped output."""
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    out64, ref64 = out.detach().double(), ref.detach().double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def _judge_against_baseline(impl, case: Case, device: torch.device, built: Built, x: torch.Tensor,
                            what: str) -> CaseResult:
    """Forward in ``case.dtype`` against float64; its RMS and max errors may be RMS_FACTOR and MAX_FACTOR times
    those of the harness's math path (``reference_forward`` in the same dtype, on the same device)."""
    low = DTYPES[case.dtype]
    x_low = x.to(low)  # the rounding the implementation sees
    ref = built.reference(x_low)
    baseline = reference_forward(x_low.to(device), built.weights.to(device=device), built.spec.num_heads).cpu()
    with torch.no_grad():
        out = built.module(x_low.to(device)).cpu()
    floor = BASELINE_FLOOR[case.dtype]
    base_rms, base_max = _rms_error(baseline, ref), rel_error(baseline, ref)
    rms, worst = _rms_error(out, ref), rel_error(out, ref)
    tol_rms, tol_max = max(RMS_FACTOR * base_rms, floor), max(MAX_FACTOR * base_max, floor)
    if rms <= tol_rms and worst <= tol_max:
        return _row(impl, case, device, "pass", rms, tol_rms,
                    f"RMS error {rms:.2g} (math path {base_rms:.2g}), max {worst:.2g} (math path {base_max:.2g})")
    if out.shape != ref.shape:
        why = f"output shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    elif not torch.isfinite(out).all():
        where = (~torch.isfinite(out)).nonzero()[0].tolist()
        why = f"non-finite output (first at batch {where[0]}, position {where[1]})"
    elif rms > tol_rms:
        why = (f"RMS error {rms:.3g} > {RMS_FACTOR:g} x the {base_rms:.2g} of the harness's math path in {case.dtype} "
               f"(tolerance {tol_rms:.2g})")
    else:
        why = (f"max error {worst:.3g} > {MAX_FACTOR:g} x the {base_max:.2g} of the harness's math path in "
               f"{case.dtype} (tolerance {tol_max:.2g})")
    return _row(impl, case, device, "fail", rms, tol_rms, f"{case.kind}: {what}: {why}")


def _run_extreme_logits(impl, case: Case, device: torch.device) -> CaseResult:
    """Scores at +EXTREME_LOGIT (overflow), then a row with every score near -EXTREME_LOGIT (underflow)."""
    spec = case.shape.spec
    w, x = _weights_and_input(case)
    built = _build(impl, case, device, w)
    if built.spec.qk_norm is not None:  # a class that always norms q and k (own_spec): rescaling W_q/W_k cannot push it
        return _row(impl, case, device, "skip", None, None, f"{case.kind}: its QK-norm bounds the scores (|q.k| <= "
                    "gains * head_dim after the norms): rescaled W_q/W_k cannot reach the extreme scores")
    w = built.zeroed(w)  # what the module has (no bias it lacks), before rounding: the stress is built from it
    target = EXTREME_LOGIT[case.dtype]
    for kind, what in (("overflow", f"largest score +{target:g}"), ("underflow", f"a row of scores all in [-{target:g}, "
                                                                                   f"-{0.9 * target:g}]")):
        w_x, x_x = _extreme_weights(x, w, spec.num_heads, target, kind)
        stressed = built.reload(w_x)
        short = _stress_not_held(stressed, x_x, spec.num_heads, target, kind)
        if short:
            return _row(impl, case, device, "skip", None, None, f"{case.kind}: {short}")
        result = _judge_against_baseline(impl, case, device, stressed, x_x, f"{what} (T={case.shape.seq_len})")
        if result.status != "pass":
            return result
    return result


def _stress_not_held(built: Built, x: torch.Tensor, num_heads: int, target: float, kind: str) -> str | None:
    """Why a factorised layer (MLA: W_k = W_UK @ W_DKV) cannot hold the stress weights, or ``None``: the weights it
    holds after loading them (its reference's) no longer reach the extreme scores asked for."""
    if not composed(built.module):
        return None
    scores = _logits(x.to(built.weights.W_q.dtype), built.weights, num_heads)
    allowed = scores.isfinite()
    reached = float(scores[allowed].max()) if kind == "overflow" else -float(scores[allowed].max(dim=-1).values.min())
    if reached >= 0.5 * target:
        return None
    return (f"{type(built.module).__name__}'s latent factorisation cannot hold the {kind} stress weights (a rank-one "
            f"key offset and rescaled W_q/W_k): with the weights it holds the extreme score is {reached:.3g}, not "
            f"{'+' if kind == 'overflow' else '-'}{target:g}; its other cases check it")


def _run_low_precision(impl, case: Case, device: torch.device) -> CaseResult:
    """float16/bfloat16 at long T: errors within a small factor of the math path's in the same dtype."""
    w, x = _weights_and_input(case)
    return _judge_against_baseline(impl, case, device, _build(impl, case, device, w), x, f"T={case.shape.seq_len}")


# --- long and awkward lengths ---------------------------------------------------------------------

def _run_long_seq(impl, case: Case, device: torch.device) -> CaseResult:
    """Forward at every length of LONG_SHAPES (shortest first) on one module, then a backward at the longest."""
    spec = case.shape.spec
    lengths = LONG_SHAPES[case.shape.id][1]
    w, x_full = _weights_and_input(case)
    built = _build(impl, case, device, w)
    module = built.module
    worst = 0.0
    for T in lengths:
        x = x_full[:, :T].contiguous()
        ref = built.reference(x)
        try:
            with torch.no_grad():
                out = module(x.to(device=device, dtype=DTYPES[case.dtype])).cpu()
        except Exception as exc:
            return _row(impl, case, device, "error", None, None,
                        f"long_seq: T={T} (context_length {spec.context_length}) raised {_exc_line(exc)}{_passed(lengths, T)}")
        err = rel_error(out, ref)
        worst = max(worst, err)
        if err > tolerance(case.dtype):
            why = (f"output shape {tuple(out.shape)} != expected {tuple(ref.shape)}" if out.shape != ref.shape
                   else "non-finite output" if math.isinf(err) else f"error {err:.3g}")
            return _row(impl, case, device, "fail", err, tolerance(case.dtype),
                        f"long_seq: T={T} (context_length {spec.context_length}): {why} > tolerance "
                        f"{tolerance(case.dtype):.2g}{_passed(lengths, T)}")
    if not impl.supports_backward(device):
        return _row(impl, case, device, "pass", worst, tolerance(case.dtype),
                    f"T in {lengths}; no backward (declares none on {device.type})")
    try:
        back = run_backward(impl, Case("backward", case.shape, case.dtype), device)
    except Exception as exc:
        return _row(impl, case, device, "error", None, None,
                    f"long_seq: backward at T={case.shape.seq_len} (every forward passes) raised {_exc_line(exc)}")
    if back.status == "fail":
        return _row(impl, case, device, "fail", back.error, back.tolerance,
                    f"long_seq: backward at T={case.shape.seq_len} (every forward passes): {back.message}")
    return _row(impl, case, device, "pass", worst, tolerance(case.dtype),
                f"T in {lengths}" + ("" if back.status == "pass" else f"; backward {back.status}: {back.message}"))


def _passed(lengths, T: int) -> str:
    """``"; T=64, 128 passed in this case"`` for the lengths before ``T`` (said only of this case's own lengths: the
    forward cases at other shapes are judged on their own), or ``""`` when ``T`` is the first."""
    before = [str(t) for t in lengths if t < T]
    return f"; T={', '.join(before)} passed in this case" if before else ""


# --- dropout statistics ---------------------------------------------------------------------------

def _fork_rng(device: torch.device):
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type)


def _run_dropout_mean(impl, case: Case, device: torch.device) -> CaseResult:
    """Train-mode outputs averaged over fixed seeds converge to the eval output (see DROPOUT_FALSE_ALARM)."""
    if not impl.supports_dropout(device):
        return _row(impl, case, device, "skip", None, None, f"declares no dropout on {device.type}")
    spec = replace(case.shape.spec, dropout=DROPOUT_P)
    w, x = _weights_and_input(case)
    low = DTYPES[case.dtype]
    module = _build(impl, case, device, w, spec).module
    x = x.to(device=device, dtype=low)
    many = x.repeat(DROPOUT_REPLICAS, 1, 1)  # (R*b, T, d_in): replica r is rows r*b:(r+1)*b
    seed0 = 1_000 * seed_for(case.shape)
    with torch.no_grad(), _fork_rng(device):
        ev = module.eval()(x).double().cpu()
        module.train()
        samples = []
        for i in range(DROPOUT_CALLS):
            torch.manual_seed(seed0 + i)
            out = module(many).double().cpu()
            samples.append(out.reshape(DROPOUT_REPLICAS, *x.shape[:2], -1).mean(0))
    samples = torch.stack(samples)  # (calls, b, T, d_out)
    mean, sd = samples.mean(0), samples.std(0)
    if mean.shape != ev.shape:
        return _row(impl, case, device, "fail", math.inf, None,
                    f"dropout_mean: train output shape {tuple(mean.shape)} != eval shape {tuple(ev.shape)}")
    scale = float(ev.abs().max())
    t = (mean - ev).abs() / (sd / math.sqrt(DROPOUT_CALLS) + 1e-6 * scale)  # the floor covers fp rounding only
    limit = float(stats.t.isf(DROPOUT_FALSE_ALARM / (2 * t.numel()), DROPOUT_CALLS - 1))
    worst = float(t.max()) if torch.isfinite(t).all() else math.inf
    if worst <= limit:
        return _row(impl, case, device, "pass", worst, limit, f"max |t| over {t.numel()} outputs")
    i = int(t.flatten().nan_to_num(math.inf).argmax())
    b_i, pos, col = (int(v) for v in torch.unravel_index(torch.tensor(i), t.shape))
    ratio = float(((mean - ev).flatten() @ ev.flatten()) / (ev.flatten() @ ev.flatten()).clamp_min(1e-30)) + 1
    return _row(impl, case, device, "fail", worst, limit,
                f"dropout_mean: with dropout={DROPOUT_P} the train-mode mean over {DROPOUT_CALLS * DROPOUT_REPLICAS} "
                f"draws does not converge to the eval output (|t| = {worst:.3g} > {limit:.3g} at batch {b_i}, "
                f"position {pos}, column {col}; mean/eval ~ {ratio:.3g}): inverted dropout must scale kept "
                f"attention weights by 1/(1-p) and apply after the softmax")


# --- strided inputs -------------------------------------------------------------------------------

def _strided_views(b: int, T: int, d: int) -> list[tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]:
    """``(name, base shape, view)`` with ``view(base)`` a non-contiguous ``(b, T, d)`` tensor."""
    return [
        ("transposed view (b, d_in, T).transpose(1, 2)", (b, d, T), lambda t: t.transpose(1, 2)),
        ("feature slice x[..., 2:2 + d_in] of a wider tensor", (b, T, d + 5), lambda t: t[..., 2:2 + d]),
        ("every other token x[:, 1::2] of a longer tensor", (b, 2 * T, d), lambda t: t[:, 1::2]),
        ("expanded batch x.expand(b, T, d_in) of one row (stride 0)", (1, T, d), lambda t: t.expand(b, T, d)),
        ("sequence-first (T, b, d_in).transpose(0, 1)", (T, b, d), lambda t: t.transpose(0, 1)),
    ]


def _forward_and_grads(module, base: torch.Tensor, view, g: torch.Tensor | None, contiguous: bool):
    """Output for ``view(base)`` (or its contiguous copy) and, when ``g`` is given, the gradients of
    ``<out, g>`` by name: ``x`` (with respect to ``base``) and every trainable parameter."""
    x = view(base)
    if g is None:
        with torch.no_grad():
            return module(x.contiguous() if contiguous else x), {}
    out = module(x.contiguous() if contiguous else x)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [base] + [p for _, p in params], grad_outputs=g, allow_unused=True)
    return out.detach(), dict(zip(["x"] + [n for n, _ in params], grads, strict=True))


def _run_strided_input(impl, case: Case, device: torch.device) -> CaseResult:
    """Every non-contiguous view of x (backpropagated with a non-contiguous grad_output) gives its contiguous
    copy's output and gradients (input and weights)."""
    spec, low = case.shape.spec, DTYPES[case.dtype]
    b, T = case.shape.batch, case.shape.seq_len
    w, _ = _weights_and_input(case)
    module = _build(impl, case, device, w, spec).module
    backward = impl.supports_backward(device)
    gen = torch.Generator().manual_seed(seed_for(case.shape))
    g = torch.randn(b, T, spec.d_out, generator=gen, dtype=torch.float64).to(device=device, dtype=low)
    g_strided = g.transpose(1, 2).contiguous().transpose(1, 2)  # the same values: strided x gets a strided grad_output
    worst = 0.0
    for name, base_shape, view in _strided_views(b, T, spec.d_in):
        base = torch.randn(base_shape, generator=gen, dtype=torch.float64).to(device=device, dtype=low)
        want_out, want_grads = _forward_and_grads(module, base.clone().requires_grad_(backward), view,
                                                  g if backward else None, True)
        try:
            out, grads = _forward_and_grads(module, base.clone().requires_grad_(backward), view,
                                            g_strided if backward else None, False)
        except Exception as exc:  # the implementation refuses a layout every torch op accepts
            return _row(impl, case, device, "fail", None, None,
                        f"strided_input: refuses a non-contiguous input ({name}, strides {view(base).stride()}"
                        f"{', with a transposed grad_output' if backward else ''}): {_exc_line(exc)}; a layer must "
                        "accept any strided x and gradient (use reshape() or .contiguous(), not view() or raw storage)")
        errors = {"output": (rel_error(out, want_out), tolerance(case.dtype))}
        floor = 1e-2 * max((float(t.abs().max()) for t in want_grads.values() if t is not None), default=0.0)
        for n, want in want_grads.items():
            got = grads[n]
            e = 0.0 if got is None and want is None else (
                math.inf if got is None or want is None else rel_error(got.cpu(), want.cpu(), floor))
            errors[f"grad {n}"] = (e, tolerance(case.dtype, grad=True))
        worst = max([worst] + [e for e, _ in errors.values()])
        for what, (err, tol) in errors.items():  # the output first: a wrong output explains wrong gradients
            if err > tol:
                return _row(impl, case, device, "fail", err, tol,
                            f"strided_input: {name}: {what} differs from the contiguous copy's (error {err:.3g} > {tol:.0e})")
    return _row(impl, case, device, "pass", worst, tolerance(case.dtype),
                "5 layouts, output" + (" and gradients" if backward else f" only (no backward on {device.type})"))


# --- no side effects ------------------------------------------------------------------------------

def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # reshape(-1): a 0-dim tensor (a frozen scalar scale, PatchTST's) cannot be viewed as bytes of another size
    return a.shape == b.shape and torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                                              b.detach().contiguous().reshape(-1).view(torch.uint8))


def _changed(module, x: torch.Tensor, x_before: torch.Tensor, params_before: dict[str, torch.Tensor]) -> str | None:
    if not _same_bits(x, x_before):
        return "the input x was modified in place"
    for name, p in module.named_parameters():
        if name in params_before and not _same_bits(p, params_before[name]):
            return f"parameter {name} changed"
    return None


def _run_no_side_effects(impl, case: Case, device: torch.device) -> CaseResult:
    """x and every parameter bit-identical after an eval forward, a train forward and a backward."""
    spec, low = case.shape.spec, DTYPES[case.dtype]
    w, x = _weights_and_input(case)
    module = _build(impl, case, device, w, spec).module
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    x = x.to(device=device, dtype=low)
    x_before = x.clone()

    def fail(step: str, what: str) -> CaseResult:
        return _row(impl, case, device, "fail", None, None,
                    f"no_side_effects: {what} by {step} (batch {case.shape.batch}, T={case.shape.seq_len}); "
                    "a layer must not write to its input or its weights")

    with torch.no_grad():
        module.eval()(x)
    if what := _changed(module, x, x_before, params):
        return fail("an eval forward under no_grad", what)
    module.train()  # dropout is 0: the same function, with autograd recording where it has a backward
    backward = impl.supports_backward(device)
    leaf = x_before.clone().requires_grad_(backward)
    x_in = leaf * 1  # an activation, as a previous layer hands it over (not a leaf)
    with torch.set_grad_enabled(backward):
        out = module(x_in)
    if what := _changed(module, x_in, x_before, params):
        return fail("a train-mode forward", what)
    if backward:
        out.backward(torch.ones_like(out))
        if what := _changed(module, x_in, x_before, params):
            return fail("the backward", what)
    return _row(impl, case, device, "pass", 0.0, 0.0, "eval forward, train forward" + (", backward" if backward else ""))


# --- repeated calls with changing shapes ----------------------------------------------------------

def _blame_state(impl, case: Case, device: torch.device, spec: AttnSpec, x_dev: torch.Tensor, ref: torch.Tensor,
                 i: int) -> str:
    """What a failed call of the sequence says about state, verified: a freshly built module given the same input
    passes (state kept from the earlier calls) or fails too (no earlier call is needed to show it)."""
    if i == 0:
        return ""
    try:
        fresh = _build(impl, case, device, random_weights(spec, seed=seed_for(case.shape))).module
        with torch.no_grad():
            alone = fresh.eval()(x_dev.clone()).cpu()
        ok = rel_error(alone, ref) <= tolerance(case.dtype)
    except Exception:
        ok = False
    if ok:
        return "; a freshly built module computes this call right: state kept from an earlier call (a cache keyed on " \
               "the first shape or tensor?)"
    return "; a freshly built module fails this call too (no earlier call is needed: see the forward cases)"


def _run_shape_sequence(impl, case: Case, device: torch.device) -> CaseResult:
    """One module, eval calls of SEQUENCE's shapes in order: each output equals the reference of its own input."""
    spec, low = case.shape.spec, DTYPES[case.dtype]
    built = _build(impl, case, device, random_weights(spec, seed=seed_for(case.shape)))
    module = built.module
    gen = torch.Generator().manual_seed(seed_for(case.shape) + 1)
    buffer, worst, seen = None, 0.0, []
    for i, (b, T) in enumerate(SEQUENCE):
        x = torch.randn(b, T, spec.d_in, generator=gen, dtype=torch.float64)
        if i == 1:  # same shape as call 0: write new values into call 0's tensor
            buffer.copy_(x.to(device=device, dtype=low))
            x_dev = buffer
        else:
            x_dev = x.to(device=device, dtype=low)
            buffer = x_dev if buffer is None else buffer
        how = "same tensor as call 1, new values" if i == 1 else f"batch {b}, T={T}"
        before = " after calls (batch, T) = " + ", ".join(f"({pb}, {pT})" for pb, pT in seen) if seen else ""
        ref = built.reference(x_dev)  # before the call: it may write to x
        try:
            with torch.no_grad():
                out = module.eval()(x_dev).cpu()
        except Exception as exc:
            return _row(impl, case, device, "error", None, None,
                        f"shape_sequence: call {i + 1} ({how}){before} raised "
                        f"{_exc_line(exc)}{_blame_state(impl, case, device, spec, x_dev, ref, i)}")
        err = rel_error(out, ref)
        worst = max(worst, err)
        if err > tolerance(case.dtype):
            return _row(impl, case, device, "fail", err, tolerance(case.dtype),
                        f"shape_sequence: call {i + 1} ({how}){before}: "
                        f"{'non-finite or mis-shaped output' if math.isinf(err) else f'error {err:.3g}'}"
                        f"{_blame_state(impl, case, device, spec, x_dev, ref, i)}")
        seen.append((b, T))
    return _row(impl, case, device, "pass", worst, tolerance(case.dtype), f"{len(SEQUENCE)} calls")


RUNNERS: dict[str, Callable[..., CaseResult]] = {
    "extreme_logits": _run_extreme_logits, "long_seq": _run_long_seq, "dropout_mean": _run_dropout_mean,
    "strided_input": _run_strided_input, "no_side_effects": _run_no_side_effects,
    "shape_sequence": _run_shape_sequence, "low_precision": _run_low_precision,
}
"""Case kind -> runner ``(impl, case, device) -> CaseResult``; :mod:`attnbench.correctness.matrix` runs them
after its own kinds."""
CASE_MODES = {"dropout_mean": "forward"}  # train mode: the resolver skips implementations without dropout
CASE_DROPOUT = {"dropout_mean": DROPOUT_P}
