"""The workload of a variable-length cell (issue 37): its module, its batch in the implementation's layout, one step.

Kept apart from :mod:`attnbench.runner.workload` (which delegates here for a cell with ``lengths``) so that neither
imports the other. :class:`VarlenWorkload` has the attributes every view reads from a
:class:`~attnbench.runner.workload.Workload` (``step``, ``x``, ``module``, ``spec``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnbench import registry
from attnbench.correctness.cases import reference
from attnbench.resolve import Ready, ready_for
from attnbench.results.schema import Cell
from attnbench.runner import setup, varlen
from attnbench.spec import AttnSpec, positional_from_text
from attnbench.weights import random_weights, zero_held


@dataclass
class VarlenWorkload:
    """A built variable-length cell: call :meth:`step` for one iteration of its mode."""

    cell: Cell
    spec: AttnSpec
    module: nn.Module
    x: torch.Tensor  # the batch in the implementation's layout: (batch, longest, d) or (1, tokens, d)
    grad_out: torch.Tensor | None
    device: torch.device
    step: Callable[[], torch.Tensor]
    parts: varlen.VarlenParts
    prepare: Callable[[], object] | None = None  # the setup alone (attnbench.runner.setup), None without prepare()
    setup_policy: str = "per-call"
    kv_cache_bytes: float | None = None
    timed_step: Callable[[], torch.Tensor] | None = None
    restore: Callable[[], None] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def check_output(self, out: torch.Tensor) -> str | None:
        """Why ``out`` is not a valid result (shape of the layout, dtype, non-finite real tokens), or None."""
        return varlen.check_output(out, self.cell, self.parts, self.x)

    def analytic_flops(self) -> float:
        """The useful FLOPs of one step over the real lengths (:func:`attnbench.runner.varlen.varlen_flops`)."""
        c = self.cell
        return varlen.varlen_flops(self.parts.lengths, c.d_model, c.mode, c.num_heads, c.causal)

    def extra_columns(self, median_s: float) -> dict:
        """The lengths' columns, what the FLOPs count, and the setup measured apart."""
        return {**varlen.summary(self.parts.lengths), "flops_count": varlen.FLOPS_COUNT,
                **setup.columns(self.prepare, self.device, self.setup_policy)}

    def accuracy_parts(self, seed: int, output: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """For issue 38's error columns (:func:`attnbench.measure.accuracy.measure`): the real tokens of ``output`` (one
        more call when None), the float64 reference run on each sequence alone, and the harness's plain math in the
        cell's dtype run the same way, each ``(tokens, d)`` on the CPU. Gradients are not compared for these rows."""
        if output is None:
            with torch.no_grad():
                output = self.step()
        w = zero_held(self.module, random_weights(self.spec, seed=seed, scale="linear").to(dtype=self.x.dtype))
        pieces = torch.split(self.parts.packed, list(self.parts.lengths))
        ref = torch.cat([reference(p[None].to(torch.float64), w.to(dtype=torch.float64), self.spec)[0] for p in pieces])
        low = torch.cat([reference(p[None].to(self.device), w.to(device=self.device), self.spec)[0].cpu() for p in pieces])
        return self.real_tokens(output.detach()).cpu(), ref, low

    def real_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The real tokens ``(tokens, d)`` of an output in this workload's layout."""
        return varlen.real_tokens(out, self.parts.lengths, self.parts.layout)


def varlen_spec(cell: Cell, lengths) -> AttnSpec:
    """The layer spec of a variable-length cell: its sizes and variant, ``context_length`` = the longest sequence."""
    return AttnSpec(cell.d_model, cell.d_model, max(lengths), 0.0, cell.num_heads, num_kv_heads=cell.num_kv_heads,
                    window=cell.window, causal=cell.causal, **positional_from_text(cell.positional))


def build_varlen_workload(cell: Cell, seed: int = 0, ready: Ready | None = None, policy: str = "per-call") -> VarlenWorkload:
    """Build ``cell`` (``lengths`` set): the module with the run's canonical weights, the batch drawn from ``seed`` in
    the module's layout (outside any timed region), and one step of its mode under the setup ``policy``."""
    varlen.modes_allowed(cell)
    impl = registry.get(cell.impl)
    ready = ready_for(impl, cell, ready)
    lengths, packed, padding = varlen.draw_inputs(cell, seed)
    spec = varlen_spec(cell, lengths)
    module = impl.build(spec, weights=random_weights(spec, seed=seed, scale="linear"), ready=ready)  # as a layer cell
    layout = varlen.layout_of(module)
    x = varlen.to_layout(packed, lengths, layout, padding).to(device=ready.device, dtype=ready.dtype)
    parts = varlen.VarlenParts(lengths, layout, packed.to(ready.dtype))
    call, prepare = setup.bind(module, x, setup.check_policy(policy), lengths=lengths)
    grad_out = None
    if cell.mode == "forward+backward":
        g = torch.Generator().manual_seed(seed + 2)
        grad_out = torch.randn(x.shape[:-1] + (cell.d_model,), generator=g).to(device=ready.device, dtype=ready.dtype)
    step = varlen.mode_step(module, x, cell.mode, call, grad_out)
    notes = (f"{len(lengths)} sequences of {min(lengths)}..{max(lengths)} tokens ({sum(lengths)} in all) in the "
             f"{layout} layout; setup {policy}",)
    return VarlenWorkload(cell=cell, spec=spec, module=module, x=x, grad_out=grad_out, device=ready.device, step=step,
                          parts=parts, prepare=prepare, setup_policy=policy, notes=notes)
