"""One cell made runnable: the module (canonical weights loaded), its input, and one step of its mode.

The same :class:`Workload` is timed by ``attnbench run``, profiled by ``attnbench profile`` and
measured by the asv suite, so every view measures exactly the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnbench import registry
from attnbench.correctness.decode import missing_protocol
from attnbench.errors import PluginLoadError
from attnbench.measure.flops import analytic_flops
from attnbench.measure.memory import retained_bytes, storage_bytes
from attnbench.plugins import cache_state
from attnbench.resolve import Ready, ready_for
from attnbench.results.schema import Cell
from attnbench.runner import paging, stress
from attnbench.runner import setup as setup_cost
from attnbench.runner.masks import mask_fields
from attnbench.runner.output_check import output_problem
from attnbench.runner.varlen_workload import build_varlen_workload
from attnbench.spec import AttnSpec, positional_from_text


@dataclass
class Workload:
    """A built cell: call :meth:`step` for one iteration of its mode (no synchronisation inside)."""

    cell: Cell
    spec: AttnSpec
    module: nn.Module
    x: torch.Tensor  # (batch, seq_len, d_model)
    grad_out: torch.Tensor | None  # (batch, seq_len, d_model), forward+backward only
    device: torch.device
    step: Callable[[], torch.Tensor]  # leaves the module as it found it (a decode step restores its cache)
    kv_cache_bytes: float | None = None  # decode: the cache after the prefill (its tensors' storage, or the allocator's)
    # Decode without rewind_cache: the timer times ``timed_step`` and calls ``restore`` after each call, outside
    # the timed region (``step`` is the two together). None when ``step`` needs no restoring.
    timed_step: Callable[[], torch.Tensor] | None = None
    restore: Callable[[], None] | None = None
    notes: tuple[str, ...] = ()  # how the cache was measured and restored, for the row's notes
    columns: dict = field(default_factory=dict)  # issue 37: a paged cache's pages and fragmentation after the prefill
    prepare: Callable[[], object] | None = None  # issue 37: the module's prepare() alone (attnbench.runner.setup)
    setup_policy: str = "per-call"

    def check_output(self, out: torch.Tensor) -> str | None:
        """Why ``out`` is not a valid result (wrong shape, dtype or non-finite values), or ``None``."""
        tokens = 1 if self.cell.mode == "decode" else self.cell.seq_len
        return output_problem(out, (self.cell.batch, tokens, self.cell.d_model), self.x.dtype, "output shape")

    def analytic_flops(self) -> float:
        """The useful FLOPs of one step (:func:`attnbench.measure.flops.analytic_flops` of the layer)."""
        c = self.cell
        return analytic_flops(c.batch, c.seq_len, c.d_model, c.d_model, c.mode, num_heads=c.num_heads,
                              num_kv_heads=c.num_kv_heads, window=c.window, causal=c.causal,
                              **{k: v for k, v in mask_fields(c).items() if k in ("prefix", "documents")})

    def extra_columns(self, median_s: float) -> dict:
        """Columns this kind of workload adds to an ok row after timing: for a layer, a paged cache's pages (if any)
        and its setup measured apart (issue 37: ``setup_s``, NaN when the module has no ``prepare``, and
        ``setup_policy``)."""
        return {**dict(self.columns), **setup_cost.columns(self.prepare, self.device, self.setup_policy)}


def spec_for(cell: Cell) -> AttnSpec:
    """The layer spec of a cell: ``d_in = d_out = d_model``, ``context_length = seq_len`` (``seq_len + 1`` for
    decode: the cache holds ``seq_len`` tokens and the new one), no dropout, the cell's variant."""
    context = cell.seq_len + 1 if cell.mode == "decode" else cell.seq_len
    return AttnSpec(cell.d_model, cell.d_model, context, 0.0, cell.num_heads, num_kv_heads=cell.num_kv_heads,
                    window=cell.window, causal=cell.causal, **positional_from_text(cell.positional),
                    **mask_fields(cell))


def build_workload(cell: Cell, seed: int = 0, ready: Ready | None = None, setup: str = "per-call") -> Workload:
    """Build ``cell``'s module (canonical weights from ``seed``) and input on its device.

    ``ready`` is the :func:`attnbench.resolve.resolve` answer for the cell when the caller has it;
    otherwise the cell is resolved here. Raises :class:`~attnbench.errors.AttnbenchError` subclasses for
    impossible cells (unknown name, unavailable device/dtype/mode, d_model not divisible by heads).
    Block and model cells are built by :func:`attnbench.models.workload.build_scope_workload`; variable-length cells
    (issue 37) by :func:`attnbench.runner.varlen_workload.build_varlen_workload`. ``setup``: whether the timed call
    includes the module's ``prepare`` (:mod:`attnbench.runner.setup`).
    """
    if cell.lengths:
        return build_varlen_workload(cell, seed, ready, setup)
    if cell.batch_spec:  # issue 48: the mixed serving step
        from attnbench.runner.mixed_workload import build_mixed_workload

        return build_mixed_workload(cell, seed, ready)
    if cell.scope != "layer":
        stress.layer_only(cell)  # issue 38: stress inputs are drawn for the layer alone
        from attnbench.models.workload import build_scope_workload

        return build_scope_workload(cell, seed, ready)
    impl = registry.get(cell.impl)
    ready = ready_for(impl, cell, ready)
    device, dtype = ready.device, ready.dtype
    # what the class always applies (its QK-norm, its RoPE direction): the accuracy reference follows it
    spec = impl.own_spec(spec_for(cell))
    module = impl.build(spec, weights=stress.weights(cell, spec, seed), ready=ready)  # issue 38: --inputs
    g = torch.Generator().manual_seed(seed + 1)  # draws the input, then the decode token or the output gradient
    x = stress.stressed_input(cell, torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g), seed)
    x = x.to(device=device, dtype=dtype)
    if cell.mode == "decode":
        parts = _decode_parts(impl.name, cell, module, x, g, device)
    else:
        parts = _layer_parts(cell, module, x, g, setup)
    return Workload(cell=cell, spec=spec, module=module, x=x, grad_out=parts.pop("grad_out", None), device=device,
                    setup_policy=setup, **parts)


def _decode_parts(name: str, cell: Cell, module: nn.Module, x: torch.Tensor, g: torch.Generator,
                  device: torch.device) -> dict:
    """The :class:`Workload` fields of a decode cell: the cache prefilled with ``x`` (its bytes, a paged cache's page
    size and columns), and a step of one token (``g``'s next draw) that leaves the cache as it found it."""
    module.eval()
    missing = missing_protocol(module)
    if missing:
        raise PluginLoadError(f"{name} declares kv_cache but lacks {', '.join(missing)} (see implementations/kv_cache.py)")
    x_new = torch.randn(cell.batch, 1, cell.d_model, generator=g).to(device=device, dtype=x.dtype)
    notes = list(filter(None, [paging.configure(module, cell)]))  # issue 37: a paged cache's page size
    with cache_state.default_dtype(x.dtype):  # a cache allocated as torch.zeros(...) gets the cell's dtype
        kv_bytes, how = _prefill(module, x, device)
    notes.append(how)
    parts = dict(kv_cache_bytes=kv_bytes, columns=paging.columns(module))
    if callable(getattr(getattr(module, "_orig_mod", module), "rewind_cache", None)):
        def step() -> torch.Tensor:  # one token against seq_len cached ones; rewinding keeps the cache length fixed
            with torch.inference_mode():
                out = module(x_new, use_cache=True)
                module.rewind_cache(1)
                return out

        return dict(parts, step=step, notes=tuple(notes))

    def timed_step() -> torch.Tensor:  # one token against seq_len cached ones
        with torch.inference_mode():
            return module(x_new, use_cache=True)

    with cache_state.default_dtype(x.dtype):
        restore = cache_state.step_restorer(module, timed_step, name)
    notes.append(f"no rewind_cache: the cache is restored after each step, outside the timed region (the step "
                 f"{restore.describe()})")

    def step() -> torch.Tensor:
        out = timed_step()
        restore()
        return out

    return dict(parts, step=step, timed_step=timed_step, restore=restore, notes=tuple(notes))


def _layer_parts(cell: Cell, module: nn.Module, x: torch.Tensor, g: torch.Generator, setup: str) -> dict:
    """The :class:`Workload` fields of an inference, forward or forward+backward cell: the step (the module's
    ``prepare`` bound by the ``setup`` policy), the setup alone, and for forward+backward the output gradient
    (``g``'s next draw)."""
    if cell.mode == "inference":
        module.eval()
        call, prepare = setup_cost.bind(module, x, setup)

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return call()

        return dict(step=step, prepare=prepare)
    module.train()
    if cell.mode == "forward":
        step, prepare = setup_cost.bind(module, x, setup)
        return dict(step=step, prepare=prepare)
    x.requires_grad_(True)
    grad_out = torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g).to(device=x.device, dtype=x.dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    call, prepare = setup_cost.bind(module, x, setup)

    def step() -> torch.Tensor:
        for p in params:  # set_to_none semantics: no memset, no stale accumulation
            p.grad = None
        x.grad = None
        out = call()
        out.backward(grad_out)
        return out

    return dict(step=step, prepare=prepare, grad_out=grad_out)


def _prefill(module: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, str]:
    """Fill ``module``'s KV cache with ``x`` (outside any timed region); the bytes the cache then holds and how
    they were found: the storage of its ``cache_tensors()``; else of the tensor attributes and buffers the
    prefill created, grew or wrote into (named); else what the prefill left allocated."""
    base = getattr(module, "_orig_mod", module)

    def prefill() -> None:
        with torch.inference_mode():
            cache_state.reset_cache(module)
            module(x, use_cache=True)  # the output is dropped: only the cache stays allocated

    if callable(getattr(base, "cache_tensors", None)):
        prefill()
        return storage_bytes(base.cache_tensors()), "kv_cache_bytes from cache_tensors()"
    with torch.inference_mode():
        cache_state.reset_cache(module)
    tensors, names = cache_state.grown_cache_tensors(module, prefill)
    if tensors:
        return storage_bytes(tensors), f"kv_cache_bytes from the tensors the prefill created, grew or wrote into: {', '.join(names)}"
    with torch.inference_mode():
        cache_state.reset_cache(module)  # freed before measuring, so the prefill's allocation is not netted out
    return retained_bytes(prefill, device), "kv_cache_bytes from the allocator (what the prefill left allocated)"
