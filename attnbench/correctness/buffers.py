"""Working precision of buffers: tables a constructor builds, compared with the same tables built in float64.

A class that computes its rotary tables once in ``__init__`` (``inv_freq`` in float32, as the book's
``compute_rope_params`` does with its ``.float()``) and is then cast with ``.double()`` holds float64 buffers that are
accurate to float32 only. No op in ``forward`` shows it, and when the tables are finished in float64 their values are
not float32 numbers either, so neither the op-by-op observation nor the float32-values test of
:mod:`attnbench.correctness.precision` sees it. This module builds the class twice more and compares buffers by name:

* **as the case builds it**, then cast to float64;
* **in float64 throughout**: under ``torch.set_default_dtype(torch.float64)`` and a
  :class:`~torch.overrides.TorchFunctionMode` that turns every float32 (complex64) the constructor asks for, by
  ``dtype=``, ``.to(...)``, ``.float()`` or ``.type(...)``, into float64 (complex128).

A buffer whose two builds differ by more than float64 roundoff and no more than :data:`FLOAT32_ACCURATE` is
*float32-accurate*: it makes the class's float64 working precision float32 (the part is named in ``check``'s
working-precision line). A buffer that differs between two ordinary builds with different seeds is drawn, not
computed, and is never compared; one that differs by more than :data:`FLOAT32_ACCURATE` differs for another reason
(a branch on the default dtype) and is left alone. What the float64 build cannot widen (tables from NumPy, a dtype
read from a config field) stays as built, so such a buffer reads as exact: the test can miss a low-precision table,
never invent one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from attnbench.plugins.exits import plugin_exits

EPS64 = float(torch.finfo(torch.float64).eps)
FLOAT64_ACCURATE = 1e3 * EPS64
"""At most this relative difference (max-norm, 2.2e-13) from the float64 build: the buffer is float64-accurate."""
FLOAT32_ACCURATE = 1e-3
"""Above :data:`FLOAT64_ACCURATE` and at most this (about 8,000 float32 roundings: the angles of a long table grow
with the position): float32-accurate. More than this is not a precision effect and is not judged here."""
_WIDE = {torch.float32: torch.float64, torch.complex64: torch.complex128}


class _Float64Everywhere(TorchFunctionMode):
    """While a constructor runs: every float32 or complex64 dtype it names becomes float64 or complex128."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        elif func is torch.Tensor.cfloat:
            func = torch.Tensor.cdouble
        args = tuple(_WIDE.get(a, a) if isinstance(a, torch.dtype) else a for a in args)
        if isinstance(kwargs.get("dtype"), torch.dtype):
            kwargs["dtype"] = _WIDE.get(kwargs["dtype"], kwargs["dtype"])
        return func(*args, **kwargs)


def _build(make: Callable[[], nn.Module], seed: int, wide: bool) -> dict[str, torch.Tensor] | None:
    """The floating buffers (name -> CPU tensor) of ``make()`` cast to float64, built with ``seed`` (and in float64
    throughout when ``wide``); ``None`` when the constructor fails that way."""
    before = torch.get_default_dtype()
    try:
        with torch.random.fork_rng(devices=[]), plugin_exits("the constructor, rebuilt for its buffers"):
            torch.manual_seed(seed)
            if wide:
                torch.set_default_dtype(torch.float64)
                with _Float64Everywhere():
                    module = make()
            else:
                module = make()
            module = module.to(dtype=torch.float64)
    except Exception:  # the case's own build says what fails; a buffer that cannot be rebuilt is not judged
        return None
    finally:
        torch.set_default_dtype(before)
    if not isinstance(module, nn.Module):
        return None
    return {name: buf.detach().cpu() for name, buf in module.named_buffers()
            if buf.is_floating_point() or buf.is_complex()}


def has_floating_buffers(module: nn.Module) -> bool:
    """Whether ``module`` holds a floating (or complex) buffer of more than one element: what is worth rebuilding."""
    return any((b.is_floating_point() or b.is_complex()) and b.numel() > 1 for _, b in module.named_buffers())


def float32_valued(buf: torch.Tensor) -> bool:
    """A float64 buffer whose values are all float32 numbers, not all integers: a table built in float32, then cast
    (seen without a rebuild, by :func:`attnbench.correctness.precision.observe`)."""
    if buf.dtype != torch.float64 or buf.numel() < 2:
        return False
    return not torch.equal(buf, buf.round()) and torch.equal(buf, buf.float().double())


def difference(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """``max|a - b| / max|b|`` over the finite entries, in float64; ``None`` when the two cannot be compared
    (shapes, real against complex, infinities or NaNs in different places)."""
    if a.shape != b.shape or a.is_complex() != b.is_complex():
        return None
    if a.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a, b = a.to(torch.float64), b.to(torch.float64)
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return None
    odd_a, odd_b = a[~finite], b[~finite]
    if not bool(((odd_a == odd_b) | (odd_a.isnan() & odd_b.isnan())).all()):
        return None
    if not bool(finite.any()):
        return 0.0
    scale = float(b[finite].abs().max())
    return float((a - b)[finite].abs().max()) / max(scale, 1e-300)


def float32_accurate(make: Callable[[], nn.Module]) -> dict[str, float]:
    """The buffers of the module ``make()`` builds that hold only float32 accuracy in float64 (name -> relative
    difference from the float64 build), computed buffers only and not those :func:`float32_valued` already names."""
    plain = _build(make, seed=0, wide=False)
    if not plain:
        return {}
    wide = _build(make, seed=0, wide=True) or {}
    drawn = _build(make, seed=1, wide=False) or {}
    found = {}
    for name, buf in plain.items():
        if name not in wide or name not in drawn or buf.numel() < 2 or float32_valued(buf):
            continue
        if difference(drawn[name], buf) != 0.0:  # differs between two ordinary builds: drawn at random, not computed
            continue
        err = difference(buf, wide[name])
        if err is not None and FLOAT64_ACCURATE < err <= FLOAT32_ACCURATE:
            found[name] = err
    return found
