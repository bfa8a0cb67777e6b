"""Working precision: what a class really computes in, observed, named, and the tolerance that follows.

Many correct classes compute parts of a float64 forward in float32 on purpose: the book's chapter-5 RMSNorm
(Qwen3's ``qwen3_compatible`` mode, Gemma 3's "to match HF"), Hugging Face's rotary classes and Meta's
``apply_rotary_emb`` (float32 tables, complex64 products), softmax with ``dtype=torch.float32``. Judging such a
class at float64's 1e-9 calls correct code wrong; skipping its float64 cases hides its bugs. Instead:

* **Observe.** :func:`observe` runs the module's forward once under a :class:`~torch.utils._python_dispatch.
  TorchDispatchMode` that sees every ATen op's input and output dtypes, with forward hooks that say in which
  submodule each op ran. Ops below the case's dtype are grouped into *parts*: a q/k norm (by the module's name),
  RoPE tables (cos/sin ops, rotary modules, complex products), softmax, or the op by name. A float64 buffer whose
  values are all float32 numbers (tables built in float32 before the module was cast) is a part too: it is not
  visible as an op. So is a float64 buffer that is only float32-*accurate* (``inv_freq`` in float32, the tables
  finished in float64): given a way to build the class again, :func:`observe` compares its buffers by name with a
  float64 build of them (:mod:`attnbench.correctness.buffers`).
* **Derive a floor.** :func:`floor_errors` computes the harness's own reference with the *same parts* in float32
  (``reference_forward(..., lowp=...)``) and measures its error against the all-float64 reference, forward and
  gradients, at the case's spec. An unknown part makes the floor the error of the whole math in float32.
* **Judge.** A float64 case of such a class passes at ``max(1e-9, K * floor)`` (:data:`FLOOR_FACTOR`), and
  ``check`` says so in one line. Anything below float32 (float16, bfloat16) inside a float32 or float64 case is
  never excused: it keeps the dtype's tolerance and the failure names the op (:func:`low_ops_note`).

The observation of the module being checked is kept in a context variable (:data:`WORKING`) that
:func:`attnbench.correctness.cases.build` sets and the case runner resets, so every runner's tolerance lookup
(:func:`attnbench.correctness.cases.tolerance`) sees it without being handed it.
"""

from __future__ import annotations

import contextvars
import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from attnbench.correctness import buffers
from attnbench.plugins.qk_norm import role  # the q/k norm names the weight mapping already knows

FLOOR_FACTOR = 8.0
"""A class working in float32 somewhere passes a float64 case at ``FLOOR_FACTOR`` times the error of the
harness's math with the same parts in float32 (its own op order, fused kernels and where it converts back differ
from the harness's; the measured ratio for the book's classes is below 3), and never below ``4 * eps(float32)``
(4.8e-7: the floor is measured on one draw of inputs, the cases draw others; one seed of 20 went 9x above it)."""
LOW = (torch.float16, torch.bfloat16)
_ORDER = {torch.float64: 3, torch.complex128: 3, torch.float32: 2, torch.complex64: 2,
          torch.float16: 1, torch.bfloat16: 1}
_MOVES = {"_to_copy", "detach", "view", "_unsafe_view", "expand", "clone", "t", "transpose", "permute", "slice",
          "select", "unsqueeze", "squeeze", "alias", "lift_fresh", "copy_", "index", "cat", "reshape", "contiguous",
          "split", "split_with_sizes", "unbind", "chunk", "stack", "view_as_real", "view_as_complex", "_reshape_alias"}
_ROPE_WORDS = re.compile(r"rot|rope|freq|cos|sin|cis", re.I)
_NORM_MODULE = re.compile(r"norm", re.I)


@dataclass
class Observed:
    """What one forward computed below the case's dtype: ``parts`` (name -> dtypes, in first-seen order), the
    emulation ``kinds`` they map to (``norm``, ``rope``, ``softmax``, ``other``) and every op below float32."""

    dtype: torch.dtype
    parts: dict[str, set] = field(default_factory=dict)
    kinds: set[str] = field(default_factory=set)
    below32: list[str] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)  # conversions and views below the case's dtype
    buffer_errors: dict[str, float] = field(default_factory=dict)  # float32-accurate buffer -> difference from float64

    def add(self, part: str, kind: str, dtype: torch.dtype) -> None:
        self.parts.setdefault(part, set()).add(dtype)
        self.kinds.add(kind)

    @property
    def in_float32(self) -> bool:
        """Parts in float32 (not lower) inside a float64 case: what the relaxed float64 tolerance is for."""
        return self.dtype == torch.float64 and bool(self.parts) and not self.below32

    def describe(self) -> str:
        """``float32 in q_norm, k_norm, RoPE tables`` (the dtypes found), or ``as given (float64)``."""
        if not self.parts:
            return f"as given ({_name(self.dtype)}) throughout"
        by_dtype: dict[str, list[str]] = {}
        for part, dtypes in self.parts.items():
            by_dtype.setdefault("/".join(sorted(_name(d) for d in dtypes)), []).append(part)
        return "; ".join(f"{d} in {', '.join(parts)}" for d, parts in by_dtype.items())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Recorder(TorchDispatchMode):
    def __init__(self, observed: Observed, where: list[str]) -> None:
        super().__init__()
        self.observed, self.where = observed, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = [t.dtype for t in pytree.tree_leaves((args, kwargs, out))
                  if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
        case = _ORDER.get(self.observed.dtype, 3)
        low = [d for d in dtypes if _ORDER.get(d, 3) < case]
        if low:
            worst = min(low, key=lambda d: _ORDER[d])
            where = self.where[-1] if self.where else ""
            if any(d.is_complex for d in low):  # Meta's apply_rotary_emb: q and k rotated as complex64 products
                self.observed.add("RoPE (q, k rotated as complex64)", "other", torch.float32)
            else:
                _classify(self.observed, func, where, worst)
        return out


def _classify(observed: Observed, func, where: str, dtype: torch.dtype) -> None:
    """Put one low-precision real-valued op into its part (complex ops are the recorder's: see the module docstring)."""
    op = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
    if dtype in LOW and observed.dtype in (torch.float32, torch.float64) and op not in _MOVES:
        observed.below32.append(f"aten.{op} in {_name(dtype)} ({where or 'forward'})")
    if op in _MOVES:  # a conversion or a view: named by the computation it feeds (observe() names it if alone)
        observed.moves.append(f"aten.{op}{f' in {where}' if where else ''}")
        return
    leaf = where.rsplit(".", 1)[-1]
    if where and (role(leaf) or _NORM_MODULE.search(leaf)):
        observed.add(leaf if role(leaf) else where, "norm", dtype)
    elif op in ("cos", "sin", "polar") or (where and _ROPE_WORDS.search(leaf)):
        observed.add("RoPE tables", "rope", dtype)
    elif op in ("_softmax", "_log_softmax", "_safe_softmax"):
        observed.add("softmax", "softmax", dtype)
    else:
        observed.add(f"aten.{op}{f' in {where}' if where else ''}", "other", dtype)


def _float32_buffers(module: nn.Module, observed: Observed) -> None:
    """Float64 buffers holding only float32 numbers (tables computed in float32, then the module cast)."""
    if observed.dtype != torch.float64:
        return
    for name, buf in module.named_buffers():
        if not buffers.float32_valued(buf):
            continue  # integers (masks, positions) or true float64 values
        kind = "rope" if _ROPE_WORDS.search(name) else "other"
        observed.add("RoPE tables" if kind == "rope" else f"buffer {name} (float32 values)", kind, torch.float32)


def _float32_accurate_buffers(module: nn.Module, observed: Observed, rebuild) -> None:
    """Float64 buffers accurate to float32 only, though their values are not float32 numbers (``inv_freq`` in
    float32, the tables finished in float64): ``rebuild()`` builds the class again, as the case did and in float64
    throughout, and the buffers are compared by name (:mod:`attnbench.correctness.buffers`)."""
    if rebuild is None or observed.dtype != torch.float64 or not buffers.has_floating_buffers(module):
        return
    found = buffers.float32_accurate(rebuild)
    observed.buffer_errors.update(found)
    for kind in ("rope", "other"):
        names = [n for n in found if (kind == "rope") == bool(_ROPE_WORDS.search(n))]
        if names:
            observed.add(f"buffer{'s' * (len(names) > 1)} {', '.join(names)} (built float32-accurate by the "
                         "constructor)", kind, torch.float32)


def observe(module: nn.Module, call, dtype: torch.dtype, rebuild=None) -> Observed:
    """Run ``call()`` (one forward of ``module``) and return what it computed below ``dtype``. ``rebuild``, a
    function that constructs the same class again for the same spec (not cast, no weights loaded), lets a float64
    observation also compare the buffers the constructor builds with a float64 build of them."""
    observed = Observed(dtype)
    where: list[str] = []
    hooks = []

    def leave(_module, _args, _output) -> None:  # returns None: a forward hook's return value replaces the output
        if where:
            where.pop()

    for path, sub in module.named_modules():
        if path:
            hooks.append(sub.register_forward_pre_hook(lambda m, a, p=path: where.append(p)))
            hooks.append(sub.register_forward_hook(leave))
    try:
        with torch.no_grad(), _Recorder(observed, where):
            call()
    finally:
        for h in hooks:
            h.remove()
    _float32_buffers(module, observed)
    _float32_accurate_buffers(module, observed, rebuild)
    if observed.moves and not observed.parts:  # values rounded through a lower dtype and back: precision lost all the same
        observed.add(f"a round trip through a lower dtype ({observed.moves[0]})", "other", torch.float32)
    return observed


# --- the floor and the tolerance -------------------------------------------------------------------

@dataclass(frozen=True)
class Working:
    """The observation of the module under check and the float64 tolerances it earns."""

    observed: Observed
    forward_tol: float
    grad_tol: float


WORKING: contextvars.ContextVar[Working | None] = contextvars.ContextVar("attnbench_working_precision", default=None)
"""The working precision of the module the current case built (None: as given)."""


def summary(workings: list[Working]) -> str | None:
    """``working precision: float32 in q_norm, k_norm (...)``: what ``check`` says of one class over the builds of its
    cases (``workings``), or ``None`` when every one computed in the dtype it was given. Anything below float32 is
    named first: it is never excused."""
    low = [w.observed for w in workings if w.observed.below32]
    if low:
        return (f"working precision: {low[0].describe()} (below float32 inside a {_name(low[0].dtype)} case: "
                "never excused)")
    merged = Observed(torch.float64)
    for observed in (w.observed for w in workings if w.observed.dtype == torch.float64):
        for part, dtypes in observed.parts.items():
            for d in dtypes:
                merged.add(part, "", d)
    if not merged.parts:
        return None
    return (f"working precision: {merged.describe()} (float64 cases judged at float32: against {FLOOR_FACTOR:g}x "
            "the error of the harness's math with the same parts in float32)")


def lowp_for(observed: Observed) -> frozenset[str]:
    """The reference's ``lowp`` parts for ``observed`` (every part when one is unknown: the whole math)."""
    if "other" in observed.kinds:
        return frozenset({"all"})
    return frozenset(observed.kinds)


def floor_errors(reference, rel_error, x: torch.Tensor, weights, spec, lowp: frozenset[str]) -> tuple[float, float]:
    """The forward and worst-gradient errors (``rel_error(out, ref, floor)``) of ``reference`` with ``lowp`` parts in
    float32 against the all-float64 reference, at ``x`` with ``weights`` (``reference(x, w, spec, lowp=...)``)."""
    x64, w64 = x.detach().to(torch.float64), weights.to(dtype=torch.float64)
    if "all" in lowp:
        x_low, w_low, parts = x64.float(), w64.to(dtype=torch.float32), frozenset()
    else:
        x_low, w_low, parts = x64, w64, lowp
    xa, wa = x64.clone().requires_grad_(True), w64.leaves()
    xb, wb = x_low.clone().requires_grad_(True), w_low.leaves()
    ref, low = reference(xa, wa, spec), reference(xb, wb, spec, lowp=parts)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ta, tb = dict(wa.items()), dict(wb.items())
    names = [n for n, t in ta.items() if t is not None and t.requires_grad]
    ref_grads = torch.autograd.grad((ref * g).sum(), [xa] + [ta[n] for n in names], allow_unused=True)
    low_grads = torch.autograd.grad((low * g.to(low.dtype)).sum(), [xb] + [tb[n] for n in names], allow_unused=True)
    present = [(a, b) for a, b in zip(ref_grads, low_grads, strict=True) if a is not None and b is not None]
    floor = 1e-2 * max((float(a.abs().max()) for a, _ in present), default=1.0)
    grad = max((rel_error(b, a, floor) for a, b in present), default=0.0)
    return rel_error(low, ref), grad


def working_for(observed: Observed, reference, rel_error, x, weights, spec, base_tol: float,
                base_grad: float) -> Working:
    """The :class:`Working` of ``observed``: relaxed float64 tolerances when it computes parts in float32
    (``reference`` and ``rel_error``: the matrix's, :mod:`attnbench.correctness.cases`)."""
    if not observed.in_float32:
        return Working(observed, base_tol, base_grad)
    fwd, grad = floor_errors(reference, rel_error, x, weights, spec, lowp_for(observed))
    eps32 = float(torch.finfo(torch.float32).eps)  # at least 4 float32 roundings: the floor is one draw of inputs
    fwd_tol = max(base_tol, FLOOR_FACTOR * max(fwd, eps32 / 2))
    grad_tol = max(base_grad, FLOOR_FACTOR * max(grad, eps32 / 2))
    return Working(observed, fwd_tol, grad_tol if math.isfinite(grad_tol) else base_grad)


def low_ops_note() -> str:
    """`` (computes below float32: aten.mm in bfloat16 (proj))`` for the module under check, or ``""``."""
    working = WORKING.get()
    if working is None or not working.observed.below32:
        return ""
    ops = list(dict.fromkeys(working.observed.below32))
    return f" (computes below float32 inside a {_name(working.observed.dtype)} case: {'; '.join(ops[:3])})"
