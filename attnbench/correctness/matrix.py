"""The correctness matrix: every implementation, loaded with the same canonical weights, against float64.

Cases (one :class:`Case` each) cover outputs in every dtype, gradients with respect to the input and
every canonical parameter, shapes that expose real bugs (batch 1, T = 1, odd T, T < context_length,
one head and several, head_dim 1 and 64, d_in != d_out, biases on and off) and properties (causality,
batch independence, eval-mode determinism with dropout > 0, dropout active in train mode), plus the
book's golden values for the book's own classes. The round-2 properties (extreme logits, long T,
dropout statistics, strided inputs, side effects, shape sequences, low precision) are in
:mod:`attnbench.correctness.properties`, which adds its kinds to :data:`RUNNERS`.

Errors are *relative max-norm* errors: ``max|out - ref| / max|ref|``, compared with a tolerance per
dtype. Low-precision cases compare against a reference computed from the same rounded inputs and
weights, so only the implementation's arithmetic is judged.
"""

from __future__ import annotations

import contextvars
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from torch.func import functional_call

from attnbench import registry
from attnbench.correctness import golden
from attnbench.correctness.reference import reference_forward
from attnbench.devices import DTYPES, parse_device
from attnbench.errors import AttnbenchError, SweepError, UnavailableError
from attnbench.resolve import Skip, resolve
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights, adapter_for, random_weights, state_from_canonical, zero_held

TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}
"""Relative max-norm error allowed per dtype (TF32 is switched off while checking on CUDA)."""
GRAD_TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
"""Gradients are sums of many cancelling terms, so float32 gets a looser bound than the forward."""


@dataclass(frozen=True)
class Shape:
    """One point of the shape grid: a spec plus batch and sequence length."""

    id: str
    batch: int
    seq_len: int
    spec: AttnSpec


SHAPES = [
    Shape("book_hd1", 2, 6, AttnSpec(3, 2, 6, 0.0, 2)),  # head_dim 1, d_in != d_out, T == context_length
    Shape("b1_T1", 1, 1, AttnSpec(8, 8, 4, 0.0, 2)),  # batch 1, a single token
    Shape("oddT_din_ne_dout", 3, 7, AttnSpec(12, 16, 10, 0.0, 4)),  # odd T < context_length, d_in != d_out
    Shape("one_head_bias", 2, 5, AttnSpec(16, 16, 8, 0.0, 1, True)),  # one head, q/k/v biases
    Shape("hd64_bias", 2, 9, AttnSpec(32, 128, 16, 0.0, 2, True)),  # head_dim 64, wide output
    Shape("narrow_out", 2, 8, AttnSpec(24, 8, 8, 0.0, 4, True)),  # d_in > d_out, head_dim 2
    Shape("gpt_like", 1, 33, AttnSpec(64, 64, 48, 0.0, 4)),  # d_in == d_out, longer T
    Shape("hd64_square", 2, 17, AttnSpec(128, 128, 24, 0.0, 2)),  # head_dim 64 with d_in == d_out
]
LOW_PRECISION_SHAPES = ("oddT_din_ne_dout", "hd64_bias", "gpt_like", "hd64_square")
PROPERTY_SHAPE = Shape("props", 3, 11, AttnSpec(24, 24, 16, 0.0, 3, True))  # d_in == d_out: every impl runs it
DROPOUT = 0.5


@dataclass(frozen=True)
class Case:
    """One check of one implementation."""

    kind: str  # forward | backward | causality | batch_independence | eval_deterministic | dropout_train | golden
    shape: Shape
    dtype: str


@dataclass
class CaseResult:
    """The verdict of one :class:`Case`: ``status`` is pass, fail, skip or error."""

    impl: str
    kind: str
    shape: str
    dtype: str
    device: str
    status: str
    error: float | None  # worst relative error (or absolute, for golden), None when not applicable
    tolerance: float | None
    message: str = ""


def cases(kinds: Iterable[str] | None = None) -> list[Case]:
    """Every case of the matrix (optionally only ``kinds``; an unknown kind is a :class:`SweepError`)."""
    if kinds is not None:
        kinds = list(kinds)
        unknown = [k for k in kinds if k not in RUNNERS]
        if unknown:
            raise SweepError(f"unknown check kind(s) {unknown}; use {', '.join(RUNNERS)}")
    out: list[Case] = []
    for shape in SHAPES:
        for dtype in ("float64", "float32"):
            out.append(Case("forward", shape, dtype))
            out.append(Case("backward", shape, dtype))
        if shape.id in LOW_PRECISION_SHAPES:
            out += [Case("forward", shape, "bfloat16"), Case("forward", shape, "float16")]
    out += [Case("causality", PROPERTY_SHAPE, "float64"), Case("batch_independence", PROPERTY_SHAPE, "float64"),
            Case("eval_deterministic", PROPERTY_SHAPE, "float64"), Case("dropout_train", PROPERTY_SHAPE, "float32"),
            Case("golden", SHAPES[0], "float32")]
    out += properties.cases()
    return [c for c in out if kinds is None or c.kind in set(kinds)]


_SEED = contextvars.ContextVar("attnbench_check_seed", default=0)
"""The run's seed (``run_case(..., seed=)``): every case's weights and inputs are drawn from it; 0 is the default."""


def _seed_for(shape: Shape) -> int:
    return sum(map(ord, shape.id)) + 1_000_003 * _SEED.get()


def _inputs(shape: Shape, batch: int | None = None, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1_000_003 * _SEED.get())
    return torch.randn(batch or shape.batch, shape.seq_len, shape.spec.d_in, generator=g, dtype=torch.float64)


def rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-12) -> float:
    """``max|out - ref| / max(max|ref|, floor)`` in float64 (``inf`` for non-finite or mis-shaped output)."""
    if out.shape != ref.shape:
        return math.inf
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if not torch.isfinite(out64).all():
        return math.inf
    scale = ref64.abs().max().clamp_min(floor)
    return float((out64 - ref64).abs().max() / scale)


def _verdict(impl: str, case: Case, device: str, err: float, tol: float, what: str = "") -> CaseResult:
    status = "pass" if err <= tol else "fail"
    message = "" if status == "pass" else f"{what or case.kind} error {err:.3g} > tolerance {tol:.1g}"
    return CaseResult(impl, case.kind, case.shape.id, case.dtype, device, status, err, tol, message)


def _build(impl: registry.Implementation, spec: AttnSpec, device: torch.device, dtype: str,
           weights: CanonicalWeights, train: bool = False):
    module = impl.build(spec, device, dtype, weights=weights)
    return module.train(train)


def _run_forward(impl, case: Case, device: torch.device) -> CaseResult:
    spec, dtype = case.shape.spec, case.dtype
    w = random_weights(spec, seed=_seed_for(case.shape))
    x = _inputs(case.shape)
    w_low, x_low = w.to(dtype=DTYPES[dtype]), x.to(DTYPES[dtype])  # the rounding the implementation sees
    module = _build(impl, spec, device, dtype, w_low)
    w_low = zero_held(module, w_low)  # a layer without some bias computes with it held at zero
    ref = reference_forward(x_low.double(), w_low.to(dtype=torch.float64), spec.num_heads)
    with torch.no_grad():
        out = module(x_low.to(device)).cpu()
    if out.dtype != DTYPES[dtype]:
        return CaseResult(impl.name, case.kind, case.shape.id, dtype, str(device), "fail", None, None,
                          f"output dtype {out.dtype} != input dtype {DTYPES[dtype]}")
    if out.shape != ref.shape:
        return CaseResult(impl.name, case.kind, case.shape.id, dtype, str(device), "fail", math.inf, None,
                          f"output shape {tuple(out.shape)} != expected {tuple(ref.shape)}")
    return _verdict(impl.name, case, str(device), rel_error(out, ref), TOLERANCE[dtype])


def _run_backward(impl, case: Case, device: torch.device) -> CaseResult:
    spec, dtype = case.shape.spec, case.dtype
    w = random_weights(spec, seed=_seed_for(case.shape))
    x = _inputs(case.shape)
    g = torch.randn(case.shape.batch, case.shape.seq_len, spec.d_out, generator=torch.Generator().manual_seed(7),
                    dtype=torch.float64)
    module = _build(impl, spec, device, dtype, w)
    w = zero_held(module, w)
    held = adapter_for(module).held_at_zero  # not parameters of this layer: no gradient to compare
    names = ["x"] + [n for n, _ in w.items() if n not in held]

    x_ref, w_ref = x.clone().requires_grad_(True), w.leaves()
    ref_out = reference_forward(x_ref, w_ref, spec.num_heads)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), [x_ref] + [t for n, t in w_ref.items() if n not in held])

    low = DTYPES[dtype]
    x_t = x.to(device=device, dtype=low).requires_grad_(True)
    w_t = w.to(device=device, dtype=low).leaves()
    state = state_from_canonical(module, w_t, spec)
    out = functional_call(module, state, (x_t,), strict=False)
    if out.shape != ref_out.shape:  # a wrong shape may still broadcast against the output gradient
        return CaseResult(impl.name, case.kind, case.shape.id, dtype, str(device), "fail", math.inf, None,
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
    result = _verdict(impl.name, case, str(device), worst, GRAD_TOLERANCE[dtype], what=f"grad {worst_name}")
    if result.status == "pass":
        result.message = f"worst: grad {worst_name}"
    return result


def _property_setup(impl, case: Case, device: torch.device, dropout: float = 0.0, train: bool = False):
    """``(spec, weights, module, x)`` for a property case: the case's spec (with ``dropout``), seeded
    canonical weights loaded into the module, and the case's float64 input (on the CPU)."""
    spec = AttnSpec(**{**case.shape.spec.kwargs(), "dropout": dropout})
    w = random_weights(spec, seed=_seed_for(case.shape))
    return spec, w, _build(impl, spec, device, case.dtype, w, train=train), _inputs(case.shape)


def _run_causality(impl, case: Case, device: torch.device) -> CaseResult:
    """Changing tokens at positions >= t must never change outputs before t (checked for several t)."""
    _, _, module, x = _property_setup(impl, case, device)
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
    result = _verdict(impl.name, case, str(device), worst, TOLERANCE[case.dtype])
    if result.status == "fail":
        result.message = f"outputs before position {where} changed when later tokens changed (error {worst:.3g})"
    return result


def _run_batch_independence(impl, case: Case, device: torch.device) -> CaseResult:
    """Each batch row computed alone equals the same row computed in the batch."""
    _, _, module, x = _property_setup(impl, case, device)
    with torch.no_grad():
        whole = module(x.to(device)).cpu()
        alone = torch.cat([module(x[i:i + 1].to(device)).cpu() for i in range(x.shape[0])])
    return _verdict(impl.name, case, str(device), rel_error(whole, alone), TOLERANCE[case.dtype])


def _run_eval_deterministic(impl, case: Case, device: torch.device) -> CaseResult:
    """Built with dropout > 0, eval mode is deterministic and equals the (dropout-free) reference."""
    spec, w, module, x = _property_setup(impl, case, device, dropout=DROPOUT, train=False)
    with torch.no_grad():
        a, b = module(x.to(device)).cpu(), module(x.to(device)).cpu()
    err = max(rel_error(a, reference_forward(x, zero_held(module, w), spec.num_heads)), rel_error(a, b))
    return _verdict(impl.name, case, str(device), err, TOLERANCE[case.dtype], what="eval output with dropout>0")


def _run_dropout_train(impl, case: Case, device: torch.device) -> CaseResult:
    """In train mode with dropout > 0 the output must change between calls (or no dropout is declared)."""
    _, _, module, x = _property_setup(impl, case, device, dropout=DROPOUT, train=True)
    x = x.to(device=device, dtype=DTYPES[case.dtype])
    with torch.no_grad():
        a, b = module(x).cpu(), module(x).cpu()
        module.eval()
        ev = module(x).cpu()
    changed = min(rel_error(a, b), rel_error(a, ev))
    ok = changed > 1e-3
    return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(device), "pass" if ok else "fail",
                      changed, 1e-3, "" if ok else "train-mode output does not change with dropout=0.5: dropout is "
                      "not applied (if it has none, declare attnbench_capabilities = {'dropout': False}: README, Capabilities)")


def _run_golden(impl, case: Case, device: torch.device) -> CaseResult:
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


CASE_MODES = {"backward": "forward+backward", "dropout_train": "forward"}
"""How each case kind calls the module, for :func:`attnbench.resolve.resolve` (the others: ``inference``)."""
CASE_DROPOUT = {"dropout_train": DROPOUT, "eval_deterministic": DROPOUT}
"""The dropout each case kind builds with (the others: none)."""

RUNNERS: dict[str, Callable[[registry.Implementation, Case, torch.device], CaseResult]] = {
    "forward": _run_forward, "backward": _run_backward, "causality": _run_causality,
    "batch_independence": _run_batch_independence, "eval_deterministic": _run_eval_deterministic,
    "dropout_train": _run_dropout_train, "golden": _run_golden,
}


def run_case(impl: registry.Implementation | str, case: Case, device: str = "cpu", seed: int = 0) -> CaseResult:
    """Run one case (weights and inputs drawn from ``seed``); a skip when the implementation declares it
    cannot, an ``error`` row when it raises."""
    impl = registry.get(impl) if isinstance(impl, str) else impl
    shape = case.shape
    outcome = resolve(impl, shape.spec, device=device, dtype=case.dtype, mode=CASE_MODES.get(case.kind, "inference"),
                      batch=shape.batch, seq_len=shape.seq_len, dropout=CASE_DROPOUT.get(case.kind, 0.0))
    if isinstance(outcome, Skip):
        return CaseResult(impl.name, case.kind, shape.id, case.dtype, device, "skip", None, None, outcome.reason)
    dev = outcome.device
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seed_token = _SEED.set(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return RUNNERS[case.kind](impl, case, dev)
    except UnavailableError as exc:  # found only once built (a plug-in's nn.MultiheadAttention needs d_in == d_out)
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(dev), "skip", None, None, str(exc))
    except AttnbenchError as exc:
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(dev), "error", None, None,
                          f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # the implementation under test raised: a failed case, with its message
        hint = " (no backward here? declare it in attnbench_capabilities: README, Capabilities)" if case.kind == "backward" else ""
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(dev), "error", None, None,
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300] + hint)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        _SEED.reset(seed_token)


def run_matrix(impls: Iterable[str] | None = None, device: str = "cpu", kinds: Iterable[str] | None = None,
               progress: Callable[[CaseResult], None] | None = None, seed: int = 0) -> pd.DataFrame:
    """Run every case for ``impls`` (default: all registered and available on ``device``) as a DataFrame.

    ``seed`` draws other weights and inputs for every case (0, the default, is the fixed matrix).

    Unknown names raise :class:`~attnbench.errors.UnknownImplementationError` before anything runs.
    """
    device = str(parse_device(device))  # once: "cuda" -> "cuda:0", and a missing device fails before anything runs
    resolved = [registry.get(n) for n in (list(impls) if impls else registry.available(device))]
    selected = cases(kinds)
    rows = []
    # The check's tensors are tiny: one CPU thread is as fast, and far faster on a busy machine where
    # several spinning OpenMP threads wait on each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for impl in resolved:
            for case in selected:
                result = run_case(impl, case, device, seed)
                rows.append(asdict(result))
                if progress:
                    progress(result)
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows, columns=[f for f in CaseResult.__dataclass_fields__])


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """One row per implementation, kind and dtype: counts of pass/fail/error/skip and the worst error."""
    counts = ["cases", "passed", "failed", "errors", "skipped"]
    if results.empty:
        return pd.DataFrame(columns=["impl", "kind", "dtype", *counts, "worst_error", "tolerance"])
    def agg(g: pd.DataFrame) -> pd.Series:
        err = g["error"].astype(float)
        return pd.Series({
            "cases": len(g), "passed": int((g.status == "pass").sum()), "failed": int((g.status == "fail").sum()),
            "errors": int((g.status == "error").sum()), "skipped": int((g.status == "skip").sum()),
            "worst_error": float(err.max()) if err.notna().any() else float("nan"),
            "tolerance": float(g["tolerance"].astype(float).max()) if g["tolerance"].notna().any() else float("nan"),
        })

    out = results.groupby(["impl", "kind", "dtype"], sort=False)[list(results.columns)].apply(agg).reset_index()
    return out.astype({c: int for c in counts})


# The round-2 properties (extreme logits, long T, dropout statistics, strided inputs, side effects,
# shape sequences, low precision) live in their own module, which adds its runners to RUNNERS.
from attnbench.correctness import properties  # noqa: E402
