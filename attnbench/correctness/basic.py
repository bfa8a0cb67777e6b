"""The plain case kinds of the correctness matrix: outputs and gradients against the float64 reference, and
the first properties (causality, batch independence, eval-mode determinism with dropout > 0, dropout active
in train mode, the book's golden values).

Every module is built with :func:`attnbench.correctness.cases.build`, which also gives the weights its
reference uses (parameters the module lacks held at zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.func import functional_call

from attnbench.correctness import golden
from attnbench.correctness.cases import (
    Built,
    Case,
    CaseResult,
    build,
    inputs,
    reference,
    rel_error,
    row,
    seed_for,
    tolerance,
    verdict,
)
from attnbench.correctness.diagnose import likely_cause
from attnbench.devices import DTYPES
from attnbench.spec import AttnSpec
from attnbench.weights import adapter_for, random_weights, state_from_canonical

DROPOUT = 0.5
"""The dropout eval_deterministic and dropout_train build with."""


def build_for(impl, case: Case, device: torch.device, dropout: float = 0.0, train: bool = False) -> Built:
    """The case's spec (with ``dropout``) built with the case's seeded canonical weights (see :func:`build`)."""
    spec = case.shape.spec if dropout == case.shape.spec.dropout else AttnSpec(**{**case.shape.spec.kwargs(), "dropout": dropout})
    return build(impl, spec, device, case.dtype, random_weights(spec, seed=seed_for(case.shape)), train=train)


def run_forward(impl, case: Case, device: torch.device) -> CaseResult:
    """The output in the case's dtype equals the float64 reference of the same rounded inputs and weights."""
    built = build_for(impl, case, device)
    x_low = inputs(case.shape).to(DTYPES[case.dtype])
    ref = built.reference(x_low)
    with torch.no_grad():
        out = built.module(x_low.to(device)).cpu()
    if out.dtype != DTYPES[case.dtype]:
        return row(impl, case, device, "fail", None, None, f"output dtype {out.dtype} != input dtype {DTYPES[case.dtype]}")
    if out.shape != ref.shape:
        return row(impl, case, device, "fail", math.inf, None,
                   f"output shape {tuple(out.shape)} != expected {tuple(ref.shape)}")
    result = verdict(impl, case, device, rel_error(out, ref), low_precision_tolerance(built, x_low, ref, case.dtype))
    if result.status == "fail":
        cause = likely_cause(reference, built, x_low, out, tolerance(case.dtype))
        result.message += f"; likely cause: {cause}" if cause else ""
    return result


SAME_PRECISION_FACTOR, SAME_PRECISION_FLOOR = 8.0, {"float16": 5e-4, "bfloat16": 4e-3}
"""A float16/bfloat16 forward may have at most this many times the max error of the harness's own math in the same
dtype on the same inputs (errors under the floor, about one unit roundoff, always pass), and never more than
:data:`~attnbench.correctness.cases.TOLERANCE`: the same-precision rule of the extreme-logit and low-precision
properties, for every low-precision case."""


def low_precision_tolerance(built: Built, x_low: torch.Tensor, ref: torch.Tensor, dtype: str) -> float:
    """The case's tolerance; for float16/bfloat16 also at most :data:`SAME_PRECISION_FACTOR` times what the harness's
    math gets in that dtype (``reference`` computed in it, on the CPU) on the same rounded inputs and weights."""
    tol = tolerance(dtype)
    if dtype not in SAME_PRECISION_FLOOR:
        return tol
    low = DTYPES[dtype]
    baseline = reference(x_low.detach().cpu().to(low), built.weights.to(device="cpu", dtype=low), built.spec)
    return min(tol, max(SAME_PRECISION_FACTOR * rel_error(baseline, ref), SAME_PRECISION_FLOOR[dtype]))


def run_backward(impl, case: Case, device: torch.device) -> CaseResult:
    """Gradients with respect to the input and every canonical parameter the module has equal the reference's."""
    spec, dtype = case.shape.spec, case.dtype
    built = build_for(impl, case, device)
    module, w = built.module, built.weights.to(dtype=torch.float64)
    x = inputs(case.shape).to(DTYPES[dtype]).to(torch.float64)
    g = torch.randn(case.shape.batch, case.shape.seq_len, spec.d_out, generator=torch.Generator().manual_seed(7),
                    dtype=torch.float64)
    held = adapter_for(module).held  # not parameters of this layer: no gradient to compare
    names = ["x"] + [n for n, _ in w.items() if n not in held]

    x_ref, w_ref = x.clone().requires_grad_(True), w.leaves()
    ref_out = reference(x_ref, w_ref, built.spec)  # the spec as the class computes it (own_spec)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), [x_ref] + [t for n, t in w_ref.items() if n not in held])

    low = DTYPES[dtype]
    x_t = x.to(device=device, dtype=low).requires_grad_(True)
    w_t = w.to(device=device, dtype=low).leaves()
    state = state_from_canonical(module, w_t, spec)
    out = functional_call(module, state, (x_t,), strict=False)
    if out.shape != ref_out.shape:  # a wrong shape may still broadcast against the output gradient
        return row(impl, case, device, "fail", math.inf, None,
                   f"output shape {tuple(out.shape)} != expected {tuple(ref_out.shape)}")
    grads = torch.autograd.grad((out * g.to(device=device, dtype=low)).sum(),
                                [x_t] + [t for n, t in w_t.items() if n not in held], allow_unused=True)
    # Some true gradients are structurally ~0 (the key bias: softmax cancels a per-row constant), so
    # each gradient's error is relative to at least 1% of the largest gradient, not to its own ~0.
    floor = 1e-2 * max(float(r.abs().max()) for r in ref_grads)
    worst, worst_name = 0.0, ""
    for name, got, want in zip(names, grads, ref_grads, strict=False):
        err = math.inf if got is None else rel_error(got.cpu(), want, floor)
        if err > worst or worst_name == "":
            worst, worst_name = err, name
    result = verdict(impl, case, device, worst, tolerance(dtype, grad=True), what=f"grad {worst_name}")
    if result.status == "pass":
        result.message = f"worst: grad {worst_name}"
    return result


def run_causality(impl, case: Case, device: torch.device) -> CaseResult:
    """Changing tokens at positions >= t must never change outputs before t (checked for several t)."""
    built, x = build_for(impl, case, device), inputs(case.shape)
    if not built.spec.causal:  # an encoder's attention (plugins.encoder): every token sees every token
        return row(impl, case, device, "skip", None, None, "an encoder's attention, not causal (the class's own constraint)")
    module = built.module
    worst, where = 0.0, 0
    with torch.no_grad():
        base = module(x.to(device)).cpu()
        for t in range(1, case.shape.seq_len):
            x2 = x.clone()
            x2[:, t:] = torch.randn(x2[:, t:].shape, generator=torch.Generator().manual_seed(t), dtype=x.dtype) * 3
            out = module(x2.to(device)).cpu()
            err = rel_error(out[:, :t], base[:, :t])
            if err > worst:
                worst, where = err, t
    result = verdict(impl, case, device, worst, tolerance(case.dtype))
    if result.status == "fail":
        result.message = f"outputs before position {where} changed when later tokens changed (error {worst:.3g})"
    return result


def run_batch_independence(impl, case: Case, device: torch.device) -> CaseResult:
    """Each batch row computed alone equals the same row computed in the batch."""
    module, x = build_for(impl, case, device).module, inputs(case.shape)
    with torch.no_grad():
        whole = module(x.to(device)).cpu()
        alone = torch.cat([module(x[i:i + 1].to(device)).cpu() for i in range(x.shape[0])])
    return verdict(impl, case, device, rel_error(whole, alone), tolerance(case.dtype))


def run_eval_deterministic(impl, case: Case, device: torch.device) -> CaseResult:
    """Built with dropout > 0, eval mode is deterministic and equals the (dropout-free) reference."""
    built, x = build_for(impl, case, device, dropout=DROPOUT), inputs(case.shape)
    with torch.no_grad():
        a, b = built.module(x.to(device)).cpu(), built.module(x.to(device)).cpu()
    tol, apart, wrong = tolerance(case.dtype), rel_error(a, b), rel_error(a, built.reference(x))
    result = verdict(impl, case, device, max(apart, wrong), tol)
    if result.status == "pass":
        return result
    if apart > tol:
        result.message = (f"eval mode is not deterministic with dropout={DROPOUT}: two calls differ by {apart:.3g} "
                          f"(> tolerance {tol:.2g}); dropout applied in eval mode?")
        return result
    plain = build_for(impl, case, device)  # the same weights without dropout: is dropout the cause at all?
    with torch.no_grad():
        without = rel_error(plain.module(x.to(device)).cpu(), plain.reference(x))
    cause = (f"without dropout it is wrong too (error {without:.3g}): not a dropout problem" if without > tol else
             f"without dropout it is right (error {without:.2g}): built with dropout={DROPOUT}, its eval output changes")
    result.message = f"eval output error {wrong:.3g} > tolerance {tol:.2g}; {cause}"
    return result


def run_dropout_train(impl, case: Case, device: torch.device) -> CaseResult:
    """In train mode with dropout > 0 the output must change between calls (or no dropout is declared)."""
    module = build_for(impl, case, device, dropout=DROPOUT, train=True).module
    x = inputs(case.shape).to(device=device, dtype=DTYPES[case.dtype])
    with torch.no_grad():
        a, b = module(x).cpu(), module(x).cpu()
        module.eval()
        ev = module(x).cpu()
    changed = min(rel_error(a, b), rel_error(a, ev))
    ok = changed > 1e-3
    return row(impl, case, device, "pass" if ok else "fail", changed, 1e-3,
               "" if ok else f"train-mode output does not change with dropout={DROPOUT}: dropout is not applied (if it "
               "has none, declare attnbench_capabilities = {'dropout': False}: docs/own-attention.md, Capabilities)")


def run_golden(impl, case: Case, device: torch.device) -> CaseResult:
    """The book's own classes print the book's chapter-3 values (others: a skip)."""
    expected = golden.GOLDEN_IMPLEMENTATIONS.get(impl.name)
    if expected is None:
        return CaseResult(impl.name, case.kind, "book", case.dtype, str(device), "skip", None, None,
                          "not one of the book's classes")
    torch.manual_seed(golden.SEED)
    module = impl.factory(AttnSpec(**golden.ARGS))
    with torch.no_grad():
        same, worst = golden.matches(module(golden.batch()), expected)
    return CaseResult(impl.name, case.kind, "book", case.dtype, "cpu", "pass" if same else "fail", worst, 5e-5,
                      "" if same else "does not print the book's values to 4 decimals")


RUNNERS: dict[str, Callable[..., CaseResult]] = {
    "forward": run_forward, "backward": run_backward, "causality": run_causality,
    "batch_independence": run_batch_independence, "eval_deterministic": run_eval_deterministic,
    "dropout_train": run_dropout_train, "golden": run_golden,
}
"""Case kind -> runner ``(impl, case, device) -> CaseResult``."""
CASE_MODES = {"backward": "forward+backward", "dropout_train": "forward"}
"""How these kinds call the module, for :func:`attnbench.resolve.resolve` (the others: ``inference``)."""
CASE_DROPOUT = {"dropout_train": DROPOUT, "eval_deterministic": DROPOUT}
"""The dropout these kinds build with (the others: none)."""
