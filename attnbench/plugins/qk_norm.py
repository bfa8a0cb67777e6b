"""QK-norm in a user's class: its ``q_norm``/``k_norm`` modules as the canonical effective gains ``g_q``/``g_k``.

A norm module is found by its name (``q_norm``, ``k_norm``, ``query_norm``, ``key_layernorm``, ``norm_q``, ...)
and its one trainable 1-D parameter; what that parameter *means* is measured, never read from its name: the
module is called on a constant input (where an RMSNorm's output is its effective gain) with the parameter set
to 0 and to 1. The effective gain is then ``a + b * parameter`` (``a = 0, b = 1`` for a plain RMSNorm's
``weight``; ``a = 1, b = 1`` for Gemma's ``scale``, used as ``1 + scale``), so a canonical gain ``g`` is
loaded as ``(g - a) / b`` and read back as ``a + b * parameter``. The parameter's width says where the norm
sits: ``head_dim`` (per head, Qwen3/Gemma 3) or the whole projection (OLMo).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
from torch import nn

from attnbench.spec import AttnSpec

_NORM = r"(?:rms)?(?:norm|layernorm|ln)"
_NAME = re.compile(rf"^(?:(q|query|k|key){_NORM}|{_NORM}(q|query|k|key))$")
LEVEL = 1e3
"""The constant input: at ``c * ones`` an RMSNorm gives ``g * c / sqrt(c**2 + eps)``, ``g`` to ~1e-12 at this ``c``."""


@dataclass(frozen=True)
class Gain:
    """``param`` holds canonical ``canonical`` (``g_q`` or ``g_k``) as ``effective = offset + slope * param``;
    ``placement`` is ``head`` or ``full``."""

    param: str
    canonical: str
    placement: str
    offset: float
    slope: float

    def to_param(self, g: torch.Tensor) -> torch.Tensor:
        if self.slope == 0.0:  # inert: the module does not read it (any value computes the same)
            return torch.ones_like(g)
        return (g - self.offset) / self.slope

    def to_gain(self, p: torch.Tensor) -> torch.Tensor:
        return self.offset + self.slope * p

    def describe(self) -> str:
        if self.slope == 0.0:
            return (f"{self.canonical} <- {self.param} (its module's output does not change with it: the effective gain "
                    f"is {self.offset:g} whatever it holds, so cases whose gains differ fail where it norms)")
        how = "its weight" if (self.offset, self.slope) == (0.0, 1.0) else \
            f"{self.offset:g} + {self.slope:g} * it" if self.slope != 1.0 else f"{self.offset:g} + it"
        where = "per head" if self.placement == "head" else "over the whole projection"
        return f"{self.canonical} <- {self.param} (effective gain measured: {how}; {where})"


class NormError(ValueError):
    """A q/k norm whose effective gain is not ``a + b * parameter`` (what is wrong, in words); ``b == 0`` (a module
    that ignores its parameter) is an inert :class:`Gain`, not an error."""


def role(name: str) -> str | None:
    """``"q_norm"`` -> ``"q"``, ``"key_layernorm"`` -> ``"k"``; ``None`` for other names."""
    match = _NAME.match(re.sub(r"[^a-z]", "", name.lower()))
    if not match:
        return None
    return (match.group(1) or match.group(2))[0]


def find_gains(module: nn.Module, spec: AttnSpec) -> list[Gain]:
    """The q/k norms of ``module`` (built for ``spec``) as :class:`Gain` sources; raises :class:`NormError` for a norm
    whose gain cannot be measured or whose width fits no placement."""
    gains = []
    for path, sub in module.named_modules():
        which = role(path.rsplit(".", 1)[-1]) if path else None
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.requires_grad]
        if which is None or len(own) != 1 or own[0][1].dim() != 1:
            continue
        name, param = own[0]
        width = param.shape[0]
        full = spec.d_out if which == "q" else spec.kv_dim
        placement = "head" if width == spec.head_dim else "full" if width == full else None
        if placement is None:
            raise NormError(f"{path}.{name} has width {width}, neither head_dim {spec.head_dim} nor the {which} "
                            f"projection's {full}")
        offset, slope = _measure(sub, param, f"{path}.{name}")
        gains.append(Gain(f"{path}.{name}", f"g_{which}", placement, offset, slope))
    return gains


def _measure(norm: nn.Module, param: nn.Parameter, where: str) -> tuple[float, float]:
    """``(a, b)`` of ``effective = a + b * param``, from the module's outputs at param = 0 and param = 1."""
    x = torch.full((1, param.shape[0]), LEVEL, dtype=param.dtype, device=param.device)
    try:
        with _restored(param):
            param.fill_(0.0)
            at0 = norm(x).double().flatten()
            param.fill_(1.0)
            at1 = norm(x).double().flatten()
    except Exception as exc:
        raise NormError(f"{where}: calling its module on a ({param.shape[0]},) input raised {type(exc).__name__}: {exc}") from exc
    a, b = at0, at1 - at0
    if not (torch.allclose(a, a[0].expand_as(a), atol=1e-4) and torch.allclose(b, b[0].expand_as(b), atol=1e-4)):
        raise NormError(f"{where}: its module's output on a constant input is not one gain per element "
                        "(is it an RMSNorm?)")
    if abs(float(b[0])) < 1e-3:  # a norm that ignores its weight (a bug, or a dead parameter): loaded as inert, and
        return round(float(a[0]), 4), 0.0  # the cases with other gains show it where the class norms
    return round(float(a[0]), 4), round(float(b[0]), 4)


@contextlib.contextmanager
def _restored(param: nn.Parameter):
    """Set ``param`` freely inside (no autograd); its values are put back on the way out, whatever happens."""
    saved = param.detach().clone()
    try:
        with torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            param.copy_(saved)


EPS_LEVELS = (1e-3, 3e-3)
"""Two constant inputs small enough that the epsilon shows: at ``c * ones`` with unit gain an RMSNorm gives
``c / sqrt(c**2 + eps)``, so ``eps = c**2 * (1 / y**2 - 1)``; the two must agree (else it is no RMSNorm with the
epsilon inside the square root, and nothing is inferred)."""


def measure_eps(module: nn.Module, spec: AttnSpec) -> float | None:
    """The epsilon of ``module``'s q norm (built for ``spec``), measured on constant inputs at unit gain, to three
    significant digits; ``None`` when it has no q/k norm or the two levels disagree (see :data:`EPS_LEVELS`)."""
    gains = [g for g in find_gains(module, spec) if g.canonical == "g_q"]
    if not gains:
        return None
    gain = gains[0]
    path, name = gain.param.rsplit(".", 1)
    norm = module.get_submodule(path)
    param = getattr(norm, name)
    found = []
    try:
        with _restored(param):
            param.fill_(float(gain.to_param(torch.tensor(1.0))))
            for c in EPS_LEVELS:
                y = norm(torch.full((1, param.shape[0]), c, dtype=param.dtype, device=param.device)).double().flatten()[0]
                found.append(c * c * (1.0 / float(y) ** 2 - 1.0))
    except Exception:  # its module does not run on a constant row: no epsilon inferred
        return None
    a, b = found
    if not (a >= 0 and b >= 0) or abs(a - b) > 0.02 * max(a, b, 1e-12) + 1e-9:
        return None
    eps = (a + b) / 2
    return 0.0 if eps < 1e-10 else float(f"{eps:.3g}")
