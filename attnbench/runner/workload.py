"""One cell made runnable: the module (canonical weights loaded), its input, and one step of its mode.

The same :class:`Workload` is timed by ``attnbench run``, profiled by ``attnbench profile`` and
measured by the asv suite, so every view measures exactly the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnbench import registry
from attnbench.resolve import Ready, Skip, resolve
from attnbench.results.schema import Cell
from attnbench.spec import AttnSpec
from attnbench.weights import random_weights


@dataclass
class Workload:
    """A built cell: call :meth:`step` for one iteration of its mode (no synchronisation inside)."""

    cell: Cell
    spec: AttnSpec
    module: nn.Module
    x: torch.Tensor  # (batch, seq_len, d_model)
    grad_out: torch.Tensor | None  # (batch, seq_len, d_model), forward+backward only
    device: torch.device
    step: Callable[[], torch.Tensor]

    def check_output(self, out: torch.Tensor) -> str | None:
        """Why ``out`` is not a valid result (wrong shape, dtype or non-finite values), or ``None``."""
        want = (self.cell.batch, self.cell.seq_len, self.cell.d_model)
        if not isinstance(out, torch.Tensor):
            return f"returned {type(out).__name__}, not a tensor"
        if tuple(out.shape) != want:
            return f"output shape {tuple(out.shape)} != expected {want}"
        if out.dtype != self.x.dtype:
            return f"output dtype {out.dtype} != input dtype {self.x.dtype}"
        if not bool(torch.isfinite(out.detach()).all()):
            return "output has non-finite values (nan/inf)"
        return None


def spec_for(cell: Cell) -> AttnSpec:
    """The layer spec of a cell: ``d_in = d_out = d_model``, ``context_length = seq_len``, no dropout."""
    return AttnSpec(cell.d_model, cell.d_model, cell.seq_len, 0.0, cell.num_heads)


def build_workload(cell: Cell, seed: int = 0, ready: Ready | None = None) -> Workload:
    """Build ``cell``'s module (canonical weights from ``seed``) and input on its device.

    ``ready`` is the :func:`attnbench.resolve.resolve` answer for the cell when the caller has it;
    otherwise the cell is resolved here. Raises :class:`~attnbench.errors.AttnbenchError` subclasses for
    impossible cells (unknown name, unavailable device/dtype/mode, d_model not divisible by heads).
    """
    impl = registry.get(cell.impl)
    if ready is None:
        outcome = resolve(impl, cell)
        if isinstance(outcome, Skip):
            raise outcome.exception()
        ready = outcome
    device, dtype = ready.device, ready.dtype
    spec = spec_for(cell)
    module = impl.build(spec, weights=random_weights(spec, seed=seed, scale="linear"), ready=ready)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g).to(device=device, dtype=dtype)
    grad_out = None

    if cell.mode == "inference":
        module.eval()

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return module(x)
    elif cell.mode == "forward":
        module.train()

        def step() -> torch.Tensor:
            return module(x)
    else:
        module.train()
        x.requires_grad_(True)
        grad_out = torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g).to(device=device, dtype=dtype)
        params = [p for p in module.parameters() if p.requires_grad]

        def step() -> torch.Tensor:
            for p in params:  # set_to_none semantics: no memset, no stale accumulation
                p.grad = None
            x.grad = None
            out = module(x)
            out.backward(grad_out)
            return out

    return Workload(cell=cell, spec=spec, module=module, x=x, grad_out=grad_out, device=device, step=step)
