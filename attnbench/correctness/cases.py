"""What every correctness check shares: cases and their verdicts, the run's seed, errors, and the one way to
build a module under test together with the weights its reference must use.

The case kinds live in three modules that import only this one (and the float64 reference):
:mod:`~attnbench.correctness.basic` (forward, backward, causality, ...), :mod:`~attnbench.correctness.properties`
(the round-2 properties) and :mod:`~attnbench.correctness.decode` (the KV-cache property).
:mod:`~attnbench.correctness.matrix` puts their runners in one table and runs them.

**Reference weights come from one place.** :func:`build` loads canonical weights into the module and returns,
with it, the weights the module really computes with: rounded to the case's dtype, and with every
canonical parameter its layout lacks (an output bias, q/k/v biases) held at zero. A check compares the
module with :meth:`Built.reference`, so no check can judge a bias-free layer against a reference that adds
a bias the layer does not have.
"""

from __future__ import annotations

import contextvars
import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from attnbench.correctness import precision
from attnbench.correctness.reference import reference_forward
from attnbench.devices import DTYPES
from attnbench.errors import UnavailableError
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights, adapter_for, export_weights, fit_gains, load_weights, zero_held

TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}
"""Relative max-norm error allowed per dtype (TF32 is switched off while checking on CUDA)."""
GRAD_TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
"""Gradients are sums of many cancelling terms, so float32 gets a looser bound than the forward."""


def tolerance(dtype: str, grad: bool = False) -> float:
    """The tolerance of a ``dtype`` case of the module under check: :data:`TOLERANCE` (:data:`GRAD_TOLERANCE` for
    gradients), or for a float64 case of a class that computes parts in float32 the floor derived from the
    harness's math with the same parts in float32 (:mod:`attnbench.correctness.precision`)."""
    base = (GRAD_TOLERANCE if grad else TOLERANCE).get(dtype, TOLERANCE.get(dtype, 0.0))
    working = precision.WORKING.get()
    if dtype != "float64" or working is None or not working.observed.in_float32:
        return base
    return max(base, working.grad_tol if grad else working.forward_tol)


@dataclass(frozen=True)
class Shape:
    """One point of the shape grid: a spec plus batch and sequence length."""

    id: str
    batch: int
    seq_len: int
    spec: AttnSpec


@dataclass(frozen=True)
class Case:
    """One check of one implementation."""

    kind: str  # forward | backward | causality | ... | decode | extreme_logits | ... (matrix.RUNNERS)
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


def row(impl, case: Case, device, status: str, error: float | None, tol: float | None, message: str = "") -> CaseResult:
    """A :class:`CaseResult` of ``impl`` (an Implementation) for ``case``."""
    return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(device), status, error, tol, message)


def verdict(impl, case: Case, device, err: float, tol: float, what: str = "") -> CaseResult:
    """Pass when ``err <= tol``, else a failure that says ``what`` (default: the case kind) and by how much."""
    status = "pass" if err <= tol else "fail"
    message = "" if status == "pass" else f"{what or case.kind} error {err:.3g} > tolerance {tol:.2g}{precision.low_ops_note()}"
    return row(impl, case, device, status, err, tol, message)


def exc_line(exc: BaseException) -> str:
    """``TypeName: first line of the message`` (at most 160 characters of it)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first[:160]}"


# --- the run's seed -------------------------------------------------------------------------------

SEED = contextvars.ContextVar("attnbench_check_seed", default=0)
"""The run's seed (``run_case(..., seed=)``): every case's weights and inputs are drawn from it; 0 is the default."""


def seed_for(shape: Shape) -> int:
    """The weight seed of ``shape`` in this run."""
    return sum(map(ord, shape.id)) + 1_000_003 * SEED.get()


def inputs(shape: Shape, batch: int | None = None, seed: int = 1) -> torch.Tensor:
    """The float64 input ``(batch or shape.batch, shape.seq_len, d_in)`` drawn from ``seed`` and the run's seed."""
    g = torch.Generator().manual_seed(seed + 1_000_003 * SEED.get())
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


def reference(x: torch.Tensor, w: CanonicalWeights, spec: AttnSpec, start_pos: int = 0,
              lowp: frozenset[str] = frozenset()) -> torch.Tensor:
    """``spec``'s variant (GQA/MQA, window, causal or not; RoPE, QK-norm, scale, cap) computed by the reference in
    the dtype of ``x`` and ``w``, the tokens of ``x`` at absolute positions ``start_pos, start_pos + 1, ...``
    (``lowp``: parts computed in float32, :func:`~attnbench.correctness.reference.reference_forward`)."""
    return reference_forward(x, w, spec.num_heads, window=spec.window, causal=spec.causal, spec=spec,
                             start_pos=start_pos, lowp=lowp)


# --- the one way to build a module under test ------------------------------------------------------

@dataclass(frozen=True)
class Built:
    """A module under test and the canonical weights it computes with.

    ``weights`` are on the CPU in the case's dtype: the loaded weights after rounding to that dtype, with
    the canonical parameters the module's layout lacks held at zero. Every reference is computed from them.
    """

    module: nn.Module
    weights: CanonicalWeights
    spec: AttnSpec
    dtype: str

    def reference(self, x: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """The float64 reference output for ``x`` (rounded to the case's dtype first, as the module sees it),
        its tokens at absolute positions from ``start_pos``."""
        x64 = x.detach().cpu().to(DTYPES[self.dtype]).to(torch.float64)
        return reference(x64, self.weights.to(dtype=torch.float64), self.spec, start_pos)

    def zeroed(self, w: CanonicalWeights) -> CanonicalWeights:
        """``w`` (unrounded, in its own dtype) with the canonical parameters the module lacks held at zero."""
        return zero_held(self.module, w)

    def reload(self, w: CanonicalWeights) -> Built:
        """The same module with ``w`` loaded instead (a property that rescales weights), and its reference weights."""
        return _loaded(self.module, w, self.spec, self.dtype)


def _loaded(module: nn.Module, w: CanonicalWeights, spec: AttnSpec, dtype: str) -> Built:
    w_low = w.to(device="cpu", dtype=DTYPES[dtype])  # the rounding the implementation sees
    load_weights(module, w_low, spec)
    if composed(module):  # a latent factorisation holds what it can of w: the reference takes what it holds
        w_low = export_weights(module, spec).to(device="cpu", dtype=DTYPES[dtype])
    return Built(module, zero_held(module, w_low), spec, dtype)


def composed(module: nn.Module) -> bool:
    """Whether ``module``'s canonical K/V weights are composed from low-rank factors (MLA, :mod:`attnbench.plugins.mla`):
    loading arbitrary canonical weights into it is lossy, so its references use the weights it exports."""
    return bool(getattr(getattr(adapter_for(module), "layout", None), "composed", False))


def computes_mla(impl) -> bool:
    """Whether ``impl`` declares DeepSeek-style MLA (issue 46): its factory has ``mla = True``
    (``implementations/mla_deepseek.py``)."""
    return bool(getattr(getattr(impl, "factory", None), "mla", False))


def mla_skip_reason(impl, spec: AttnSpec) -> str | None:
    """Why ``impl`` cannot run ``spec``'s DeepSeek-style MLA (it does not declare it), or ``None``."""
    if getattr(spec, "is_mla", False) and not computes_mla(impl):
        return (f"does not support DeepSeek-style MLA (kv_lora_rank={spec.kv_lora_rank}: a latent with a rotary key "
                "shared by all heads; a class that computes it declares `mla = True` on its factory)")
    return None


def build(impl, spec: AttnSpec, device: torch.device | str, dtype: str, w: CanonicalWeights,
          train: bool = False) -> Built:
    """``impl`` built for ``spec`` on ``device`` in ``dtype`` with ``w`` loaded (in ``train`` mode or eval), and the
    weights every reference for it must use (see :class:`Built`). An MLA spec for an implementation that does not
    declare MLA is an :class:`~attnbench.errors.UnavailableError` (a skipped case, :func:`mla_skip_reason`)."""
    reason = mla_skip_reason(impl, spec)
    if reason:
        raise UnavailableError(reason)
    own = impl.own_spec(spec) if hasattr(impl, "own_spec") else spec  # what the class always does, filled in
    if own != spec:
        spec, w = own, fit_gains(w, own, seed=7)
    w_low = w.to(dtype=DTYPES[dtype])
    module = impl.build(spec, device, dtype, weights=w_low).train(train)
    if composed(module):  # a low-rank K/V path (MLA, plugins.mla): the reference takes what the module computes with
        w_low = export_weights(module, spec).to(dtype=DTYPES[dtype], device=w_low.W_q.device)
    built = Built(module, zero_held(module, w_low), spec, dtype)
    _observe_working(impl, built, device)
    return built


_WORKING_CACHE: dict = {}


def working_summary(impl_name: str) -> str | None:
    """``working precision: ...`` over the builds of ``impl_name``'s cases in this process
    (:func:`attnbench.correctness.precision.summary`), or ``None`` when every one computed in its own dtype."""
    return precision.summary([w for k, w in _WORKING_CACHE.items() if k[0] == impl_name and w is not None])


def _observe_working(impl, built: Built, device) -> None:
    """Observe what ``built``'s module computes in (once per implementation, spec, dtype and seed) and set
    :data:`~attnbench.correctness.precision.WORKING` for the case (:mod:`attnbench.correctness.precision`)."""
    if built.dtype not in ("float64", "float32") or getattr(impl, "origin", "plugin") == "builtin" \
            or hasattr(built.module, "_orig_mod"):
        return  # built-ins compute in the dtype they are given (their matrix shows it); compiled code is not traced
    key = (getattr(impl, "name", repr(impl)), built.spec, built.dtype, str(device), SEED.get())
    if key not in _WORKING_CACHE:
        _WORKING_CACHE[key] = _working(built, device, getattr(impl, "factory", None))  # None: not observable
    if _WORKING_CACHE[key] is not None:
        precision.WORKING.set(_WORKING_CACHE[key])


def _working(built: Built, device, factory=None) -> precision.Working | None:
    """What ``built``'s module computes in, and the tolerances that follow; None when it cannot be observed (kept,
    so it is not tried every case). ``factory(spec)`` builds the class again: its buffers are compared with a
    float64 build of them (:mod:`attnbench.correctness.buffers`)."""
    spec = built.spec
    g = torch.Generator().manual_seed(11)
    # every position the spec allows: float32 tables lose precision as the angles grow, so the floor must see them
    x = torch.randn(2, min(spec.context_length, 256), spec.d_in, generator=g, dtype=torch.float64)
    try:  # on a copy: the case must meet the module as built (a first call may set state: a cache, a fold)
        module = copy.deepcopy(built.module).eval()
        observed = precision.observe(module, lambda: module(x.to(device=device, dtype=DTYPES[built.dtype])),
                                     DTYPES[built.dtype], rebuild=factory and (lambda: factory(spec)))
    except Exception:  # the case itself shows what fails; nothing is excused without an observation
        return None
    return precision.working_for(observed, reference, rel_error, x, built.weights, spec, TOLERANCE[built.dtype],
                                 GRAD_TOLERANCE[built.dtype])
