"""What a class's forward takes and does before its projections, probed on the class itself (issue 46).

* **Images, not sequences.** A forward that raises on a token sequence ``(B, T, C)`` but runs on an image ``(B, H, W,
  C)`` (segment-anything's ``Attention``: ``B, H, W, _ = x.shape``) or ``(B, C, H, W)`` is not a sequence attention
  layer: every case would fail with the unpacking error, so it is refused as such, naming the form it took.
* **A norm of its own input.** A bare attention layer's output moves when its input is scaled (its values scale with
  it, and its scores with the square). One whose output does not (``x -> 3x``) normalises its input before every
  projection: it computes ``attention(norm(x))``, the attention half of a pre-norm block (MEGABYTE's ``Attention``
  applies an RMSNorm with gain ``norm.g``), a function the reference, which has no norm, does not compute. It is
  refused naming the norm: the first submodule its input reaches, when that submodule is itself unmoved by the scale.

Neither probe compares the class with the reference. They run where the class is first built (``check``'s setup, a
cell), never while a plug-in loads: a ``forward(x)`` class is not run there (a crash would end a run's driver). The
calls are bounded in time and guarded against exits, as the measured probes are (:mod:`attnbench.plugins.measured`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnbench.errors import PluginLoadError
from attnbench.plugins.exits import plugin_exits
from attnbench.plugins.measured import ProbeTooSlow
from attnbench.spec import AttnSpec

SCALE = 3.0
"""The factor the input is scaled by: a norm's output does not move, a bare attention layer's does."""
INVARIANT = 1e-4
"""Unmoved: the scaled input moves the output by less than this fraction of what another input moves it."""
IMAGES = {"(B, H, W, C)": lambda d: (1, 2, 3, d), "(B, C, H, W)": lambda d: (1, d, 2, 3)}
"""The image forms tried when a sequence raises, and their probe shapes for a width ``d``."""
ADAPT = "`attnbench adapt FILE:Class` writes"
PROBE_S = 3.0
"""The longest the probe may take (a handful of calls at a 6-token shape); a slower class is not probed."""


@dataclass(frozen=True)
class FormCause:
    """What the probe found, in the words of a refusal; ``norm`` is the path of a pre-norm submodule (for an adapter)."""

    headline: str
    details: tuple[str, ...]
    fix: str
    norm: str = ""

    def error(self, name: str) -> PluginLoadError:
        return PluginLoadError(f"{name} {self.headline}", details=self.details, fix=self.fix)


def _output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    out = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"forward returned {type(out).__name__}, not a tensor")
    return out


def first_cause(module: nn.Module, d_in: int, images: bool = True) -> FormCause | None:
    """Why ``module`` (built, eval, float64; its context bound) is not a bare sequence attention layer: it takes images
    (only tried with ``images``, for a ``forward(x)``), or it norms its input before its projections; None otherwise,
    and when the probe cannot tell (it raises on sequences and images alike: the cases show what it raises)."""
    g = torch.Generator().manual_seed(46)
    x, other = (torch.randn(1, 6, d_in, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        try:
            base = _output(module, x)
        except ProbeTooSlow:
            raise
        except Exception as exc:
            return _images(module, d_in, exc) if images else None
        moved = float((_output(module, other) - base).abs().max())
        scaled = float((_output(module, x * SCALE) - base).abs().max())
    if not moved > 1e-12 or scaled > INVARIANT * moved or not any(p.dim() >= 2 for p in module.parameters()):
        return None  # moved by the scale, or no projections at all (their absence is the first cause)
    return _pre_norm(module, x)


def image_form(module: nn.Module, d_in: int) -> tuple[str, tuple[int, ...]] | None:
    """The image form (:data:`IMAGES`) ``module`` runs on, returning an image, and the probe shape it ran at; None when
    it runs on neither."""
    for form, shape in IMAGES.items():
        try:
            with torch.no_grad():
                out = _output(module, torch.randn(*shape(d_in), dtype=next(module.parameters(), torch.empty(0)).dtype))
        except ProbeTooSlow:
            raise
        except Exception:  # not this form
            continue
        if out.dim() == 4:
            return form, shape(d_in)
    return None


def _images(module: nn.Module, d_in: int, exc: Exception) -> FormCause | None:
    """The refusal of a class that raised ``exc`` on a sequence and runs on an image form, or None."""
    found = image_form(module, d_in)
    if found is None:
        return None
    form, shape = found
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return FormCause(f"takes images {form}, not token sequences (B, T, C): not a sequence attention layer",
                     (f"on a sequence (1, 6, {d_in}) its forward raised {error}; on an image {shape} it ran",),
                     f"check a sequence attention class; or {ADAPT} an adapter with a TODO where the tokens must become "
                     "the image it takes")


def _pre_norm(module: nn.Module, x: torch.Tensor) -> FormCause:
    """The refusal of a class whose output is unmoved by the scale of its input, naming the norm its input reaches."""
    path, norm = _first_on_input(module, x)
    params = [f"{path}.{n}" for n, _ in norm.named_parameters()] if norm is not None else []
    what = f" ({', '.join(params) or f'{path}: {type(norm).__name__}'})" if norm is not None else ""
    fix = (f"check the attention without it: {ADAPT} an adapter that replaces {path} with nn.Identity()" if norm is not
           None else "check the attention without it: a wrapper whose input reaches the projections unnormalised")
    return FormCause(f"applies a norm{what} to its input before the projections: a pre-norm block, not a bare "
                     "attention layer",
                     (f"measured: its output does not change when its input is scaled (x -> {SCALE:g}x), as a norm "
                      "before every projection makes it; a bare attention layer's values scale with x",), fix,
                     path if norm is not None else "")


def _first_on_input(module: nn.Module, x: torch.Tensor) -> tuple[str, nn.Module | None]:
    """The first submodule ``module``'s forward calls on ``x`` itself (its values), when it is unmoved by the scale of
    its input: the norm; ``("", None)`` when there is none (a norm written as a function)."""
    called: list[tuple[str, nn.Module]] = []

    def record(name):
        def hook(sub, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].shape == x.shape and \
                    torch.allclose(args[0].double(), x):
                called.append((name, sub))
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in module.named_modules() if n]
    try:
        with torch.no_grad():
            _output(module, x)
    finally:
        for h in hooks:
            h.remove()
    for name, sub in called:
        try:
            with torch.no_grad():
                a, b = _output(sub, x), _output(sub, x * SCALE)
        except Exception:  # not a module of one input
            continue
        if a.shape == x.shape and (a - b).abs().max() <= INVARIANT * a.abs().max():
            return name, sub
    return "", None


def probe_class(binding, plan, spec: AttnSpec, guard) -> FormCause | None:
    """:func:`first_cause` for the class ``binding`` builds at ``spec`` (``plan``: its forward's context, bound);
    ``guard`` bounds each call in time (:func:`attnbench.plugins.measured._bounded`). None when the class does not
    build or run at the probe's sizes (the cases show why), and for a class that returns no tensor."""
    from attnbench.plugins.context import bind_context

    try:
        with torch.random.fork_rng(devices=[]), plugin_exits("a probe of what its forward takes"):
            module = binding(spec).double().eval()
            module = bind_context(module, plan, spec) if plan is not None else module
            with guard:
                return first_cause(module, spec.d_in, images=plan is None)
    except Exception:  # does not build, exits, or a call ran too long: nothing found (the cases show what it does)
        return None
