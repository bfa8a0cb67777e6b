"""A block or model cell made runnable: the runner's :class:`~attnbench.runner.workload.Workload` for those scopes.

The block takes ``(batch, seq_len, d_model)`` activations; the model token ids ``(batch, seq_len)``. Modes:
``inference`` (under ``torch.inference_mode``), ``forward`` (autograd recording), ``forward+backward`` (a backward of
the block's output against a fixed gradient, or of the model's cross-entropy against fixed targets), ``train``
(that, then an AdamW step) and, for a model, ``generate-cache`` / ``generate-nocache``
(:func:`attnbench.models.generate.generate`: one step is the whole generation). After timing, the row gets attention's
share of the step (:mod:`attnbench.models.share`), the generation's phases and, with the cache, the KV cache's bytes
over every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from attnbench import registry
from attnbench.errors import PluginLoadError
from attnbench.measure import long_call
from attnbench.measure.flops import analytic_flops
from attnbench.measure.memory import retained_bytes, storage_bytes
from attnbench.models.generate import Phases, generate
from attnbench.models.share import attention_share, observed_call
from attnbench.models.zoo import ModelShape, assemble, attention_modules, layer_weights
from attnbench.plugins import cache_state
from attnbench.resolve import Ready, ready_for
from attnbench.results.schema import Cell
from attnbench.runner.output_check import output_problem
from attnbench.spec import AttnSpec

BACKWARD_MODES = ("forward+backward", "train")


def shape_of(cell: Cell) -> ModelShape:
    """The block or model of ``cell``: a model's context holds the prompt and the new tokens."""
    model = cell.scope == "model"
    return ModelShape(cell.d_model, cell.num_heads, layers=cell.layers if model else 1, vocab=cell.vocab if model else 0,
                      context=cell.seq_len + cell.new_tokens, num_kv_heads=cell.num_kv_heads, window=cell.window,
                      causal=cell.causal)


@dataclass
class ScopeWorkload:
    """A block or model cell, with the attributes and methods of :class:`attnbench.runner.workload.Workload` (which
    builds it, so this module does not import that one); ``phases`` collects each generation's timing."""

    cell: Cell
    spec: AttnSpec
    module: nn.Module
    x: torch.Tensor  # activations (block) or token ids (model)
    grad_out: torch.Tensor | None
    device: torch.device
    step: Callable[[], torch.Tensor] | None
    kv_cache_bytes: float | None = None
    timed_step: Callable[[], torch.Tensor] | None = None  # a generation needs no restoring between steps
    restore: Callable[[], None] | None = None
    notes: tuple[str, ...] = ()
    shape: ModelShape | None = None
    phases: Phases | None = None
    attn_notes: list[str] = field(default_factory=list)
    first_share: float | None = None  # attention's share of the first call (a generation's, not compiled)

    def check_output(self, out: torch.Tensor) -> str | None:
        c = self.cell
        if c.mode in ("generate-cache", "generate-nocache"):
            want, dtype = (c.batch, c.new_tokens), torch.int64
        else:
            want, dtype = (c.batch, c.seq_len, c.vocab if c.scope == "model" else c.d_model), self.module_dtype
        return output_problem(out, want, dtype, "output shape", dtype_is="expected")  # tokens: finite by kind

    def first_call(self) -> torch.Tensor:
        """The cell's first call (not a compiled one: hooks would change what it compiles). A generation's runs with the
        attention clock on (:func:`~attnbench.models.share.observed_call`), so that a long one needs no share pass."""
        if self.cell.mode not in ("generate-cache", "generate-nocache"):
            return self.step()
        out, self.first_share = observed_call(self.step, attention_modules(self.module), self.device)
        return out

    @property
    def module_dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.module.parameters() if p.is_floating_point())

    def analytic_flops(self) -> float:
        """Useful FLOPs of one step: every layer's attention (the layer model) and MLP, and the LM head."""
        return step_flops(self.cell, self.shape)

    def extra_columns(self, median_s: float) -> dict:
        """Attention's share of the step, the generation's phases and, with the cache, the KV cache's bytes."""
        self.notes = (*self.notes, *self.attn_notes)
        if self.first_share is not None and long_call.is_long(median_s):  # a long call: the first one's share stands
            out = {"attn_share": self.first_share, "attn_share_low": self.first_share, "attn_share_high": self.first_share}
            self.notes = (*self.notes, f"attention's share from the first call alone (a long call, {median_s:.1f} s)")
        else:
            out = attention_share(self.step, attention_modules(self.module), self.device,
                                  backward=self.cell.mode in BACKWARD_MODES)
        if self.phases is not None:
            out.update(self.phases.columns(median_s))
        if self.cell.mode == "generate-cache":
            out["kv_cache_bytes"] = self.kv_cache_bytes
        return out


def step_flops(c: Cell, s: ModelShape | None = None) -> float:
    """Useful FLOPs of one step of a block or model cell (``s``: its shape, default :func:`shape_of`), also what the
    runner's cost prediction (:mod:`attnbench.runner.budget`) uses before anything is built."""
    s = shape_of(c) if s is None else s
    if c.mode == "generate-nocache":
        return sum(forward_flops(c, s, t, "inference") for t in range(c.seq_len, c.seq_len + c.new_tokens))
    if c.mode == "generate-cache":
        return forward_flops(c, s, c.seq_len, "inference") + sum(
            forward_flops(c, s, t, "decode") for t in range(c.seq_len, c.seq_len + c.new_tokens - 1))
    return forward_flops(c, s, c.seq_len, "forward+backward" if c.mode == "train" else c.mode)


def forward_flops(c: Cell, s: ModelShape, tokens: int, mode: str) -> float:
    """One forward (or forward+backward) over ``tokens`` tokens (``decode``: one token against ``tokens`` cached)."""
    rows = 1 if mode == "decode" else tokens
    attn = analytic_flops(c.batch, tokens, c.d_model, c.d_model, mode, num_heads=c.num_heads,
                          num_kv_heads=c.num_kv_heads, window=c.window, causal=c.causal)
    mlp_params = 3 * c.d_model * (8 * -(-8 * c.d_model // 24)) if s.llama else 8 * c.d_model ** 2
    factor = 3.0 if mode == "forward+backward" else 1.0
    dense = 2 * c.batch * rows * (mlp_params * s.layers + (c.d_model * s.vocab if s.vocab else 0))
    return s.layers * attn + dense * factor


def build_scope_workload(cell: Cell, seed: int = 0, ready: Ready | None = None) -> ScopeWorkload:
    """Build ``cell``'s block or model: the seeded surroundings with ``cell.impl`` as every layer's attention."""
    impl = registry.get(cell.impl)
    ready = ready_for(impl, cell, ready)
    shape = shape_of(cell)
    spec = shape.spec
    module = assemble(shape, seed, lambda i: impl.build(spec, weights=layer_weights(shape, i, seed), ready=ready),
                      ready.device, ready.dtype)
    if cell.mode == "generate-cache":
        for attn in attention_modules(module):
            if cache_state.reset_method(attn) is None:
                raise PluginLoadError(f"{impl.name} declares kv_cache but has no cache-reset method "
                                      "(see implementations/kv_cache.py)")
    g = torch.Generator().manual_seed(seed + 1)
    if cell.scope == "model":
        x = torch.randint(0, cell.vocab, (cell.batch, cell.seq_len), generator=g).to(ready.device)
    else:
        x = torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g).to(device=ready.device, dtype=ready.dtype)
    w = ScopeWorkload(cell=cell, spec=spec, module=module, x=x, grad_out=None, device=ready.device, step=None,
                      shape=shape, notes=(f"{'Llama-style (RMSNorm, SwiGLU)' if shape.llama else 'pre-LN GPT'} "
                                          f"{'block' if cell.scope == 'block' else f'blocks x{shape.layers}'}",))
    w.step = _step(w, g, ready)
    if cell.mode == "generate-cache":
        w.kv_cache_bytes = _cache_bytes(w)
    return w


def _step(w: ScopeWorkload, g: torch.Generator, ready: Ready):
    """The step of ``w``'s mode (see the module)."""
    cell, module, x = w.cell, w.module, w.x
    if cell.mode in ("generate-cache", "generate-nocache"):
        module.eval()
        use_cache = cell.mode == "generate-cache"
        w.phases = Phases(cell.batch, cell.seq_len, cell.new_tokens)

        def step() -> torch.Tensor:
            gen = generate(module, x, cell.new_tokens, use_cache, device=w.device)
            w.phases.add(gen)
            return gen.tokens
        return step
    if cell.mode == "inference":
        module.eval()

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return module(x)
        return step
    module.train()
    if cell.mode == "forward":
        return lambda: module(x)
    if cell.scope == "model":
        targets = torch.randint(0, cell.vocab, (cell.batch, cell.seq_len), generator=g).to(ready.device)

        def backward(out):
            F.cross_entropy(out.flatten(0, 1), targets.flatten()).backward()
    else:
        grad_out = torch.randn(cell.batch, cell.seq_len, cell.d_model, generator=g).to(device=ready.device,
                                                                                         dtype=ready.dtype)
        w.grad_out = grad_out

        def backward(out):
            out.backward(grad_out)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5) if cell.mode == "train" else None

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        out = module(x)
        backward(out)
        if opt is not None:
            opt.step()
        return out
    return step


def _cache_bytes(w: ScopeWorkload) -> float:
    """The KV cache's bytes over every layer after a generation: the storage of each layer's ``cache_tensors()``,
    else what a generation leaves allocated (the allocator's count)."""
    layers = attention_modules(w.module)
    bases = [getattr(a, "_orig_mod", a) for a in layers]
    if all(callable(getattr(b, "cache_tensors", None)) for b in bases):
        w.step()
        w.attn_notes.append("kv_cache_bytes: every layer's cache_tensors() after a generation")
        return storage_bytes([t for b in bases for t in b.cache_tensors()])
    w.module.reset_cache()
    w.attn_notes.append("kv_cache_bytes: what a generation left allocated (the allocator)")
    return retained_bytes(w.step, w.device)
