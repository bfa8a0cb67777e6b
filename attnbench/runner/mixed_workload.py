"""Issue 48: the workload of a mixed serving cell (``batch_spec`` set): the step a server runs, timed as
``attnbench run --batch-spec`` times it, and split into its prefill and decode parts.

The step's requests (:func:`attnbench.runner.mixed.parse_batch_spec`) fall in two parts, each run as one call:

* the **prefill part**: the requests from an empty cache (``2q1k``: prefills of 1,024 tokens);
* the **decode part**: the requests over a cache (``32q1kv2k``: single-token decodes; ``4q16kv512``: chunks).

A paged cache (``implementations/paged.py``, or a class with ``attnbench_mixed_step = True``) holds each part's
requests in a cache of its own (the same weights): the prefill call appends ``Q`` tokens to empty caches, the decode
call ``Q`` tokens to caches filled (untimed) with their ``KV - Q`` earlier tokens, and every request's call is one row
of ``lengths``, so a decode is not padded to a prefill's length. After each timed step the caches are put back,
untimed (:func:`attnbench.plugins.cache_state.step_restorer`). A variable-length class (``varlen=True``) has no cache:
its prefill part is one variable-length call over the prefills' tokens, and its decode part one call over the cached
requests' *whole* sequences, of which the new tokens' outputs are kept: it recomputes the keys and values a cache
would hold, which is what the step costs without one (the notes count those tokens).

The row's time is the whole step; ``prefill_s`` and ``decode_s`` are the medians of its two calls, timed inside the
timed steps. FLOPs count each request's new tokens over the keys they see, once (:func:`mixed.mixed_flops`): the
recompute and the padding earn nothing, so GFLOP/s and speed-ups compare the same useful work.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from attnbench import registry
from attnbench.devices import synchronize
from attnbench.errors import UnavailableError
from attnbench.plugins import cache_state
from attnbench.resolve import Ready, ready_for
from attnbench.results.schema import Cell
from attnbench.runner import mixed, paging, varlen
from attnbench.runner.mixed import Request
from attnbench.runner.output_check import output_problem
from attnbench.spec import AttnSpec, positional_from_text
from attnbench.weights import random_weights, zero_held

NO_MIXED_STEP = ("runs no mixed serving step: a contiguous KV cache holds one length for the whole batch; a mixed step "
                 "needs a paged cache (set_page_size(n), forward(x, use_cache=True, lengths=...)), a class with "
                 "attnbench_mixed_step = True, or a variable-length class (docs/properties.md)")


@dataclass
class Part:
    """One call of the step: its requests (indices into the step's), its call and what was timed of it."""

    name: str  # prefill | decode
    rows: list[int]
    call: Callable[[], torch.Tensor]
    real: Callable[[torch.Tensor], torch.Tensor]  # the call's output -> (its new tokens, d), in request order
    restore: Callable[[], None] | None = None
    times_s: list[float] = field(default_factory=list)


@dataclass
class MixedWorkload:
    """A built mixed cell: :meth:`step` runs the whole step (untimed uses), ``timed_step`` the same and records each
    part's seconds, ``restore`` puts the caches back; the attributes every view reads from a ``Workload``."""

    cell: Cell
    spec: AttnSpec
    module: nn.Module
    x: torch.Tensor  # (requests, longest kv, d): request i's tokens 0 .. kv - 1 in row i
    device: torch.device
    requests: tuple[Request, ...]
    parts: list[Part]
    notes: tuple[str, ...] = ()
    columns: dict = field(default_factory=dict)
    grad_out: torch.Tensor | None = None
    kv_cache_bytes: float | None = None
    prepare: Callable[[], object] | None = None
    setup_policy: str = "per-call"

    def _run(self, record: bool) -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():  # not inference_mode: nested tensors cannot be made under it
            for part in self.parts:
                start = time.perf_counter()
                outs.append(part.call())
                if record:
                    synchronize(self.device)
                    part.times_s.append(time.perf_counter() - start)
        return outs

    def timed_step(self) -> torch.Tensor:
        """The step, each part's seconds recorded (the timer calls this, then :meth:`restore` untimed)."""
        return self._run(record=True)[-1]

    def restore(self) -> None:
        """Put every cache back as it was before the step (nothing for a class without one)."""
        for part in self.parts:
            if part.restore is not None:
                part.restore()

    def step(self) -> torch.Tensor:
        """One whole step, the caches put back: ``(1, new tokens, d)``, request by request."""
        outs = self._run(record=False)
        self.restore()
        return self.gather(outs)

    def gather(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """``(1, new tokens, d)``: the parts' real outputs in the order of the step's requests."""
        pieces: dict[int, torch.Tensor] = {}
        for part, out in zip(self.parts, outs, strict=True):
            real = part.real(out)
            starts = [0]
            for i in part.rows:
                starts.append(starts[-1] + self.requests[i].q)
            pieces.update({i: real[starts[j]:starts[j + 1]] for j, i in enumerate(part.rows)})
        return torch.cat([pieces[i] for i in range(len(self.requests))])[None]

    def check_output(self, out: torch.Tensor) -> str | None:
        """Why ``out`` (from :meth:`step`) is not a valid result: shape, dtype, non-finite values."""
        want = (1, sum(r.q for r in self.requests), self.cell.d_model)
        return output_problem(out, want, self.x.dtype, "the step's new tokens have shape")

    def analytic_flops(self) -> float:
        """The step's useful FLOPs over real tokens (:func:`attnbench.runner.mixed.mixed_flops`)."""
        c = self.cell
        return mixed.mixed_flops(self.requests, c.d_model, c.kv_heads / c.num_heads, c.window)

    def extra_columns(self, median_s: float) -> dict:
        """``tokens`` (new), ``flops_count``, and the parts' medians (``prefill_s``, ``decode_s``; NaN: no such part)."""
        split = {f"{p.name}_s": statistics.median(p.times_s) if p.times_s else float("nan") for p in self.parts}
        return {"prefill_s": float("nan"), "decode_s": float("nan"), **split, **self.columns,
                "tokens": sum(r.q for r in self.requests), "flops_count": mixed.FLOPS_COUNT}

    def accuracy_parts(self, seed: int, output: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """For the error columns: the step's new tokens ``(tokens, d)``, the float64 reference of each request's
        whole sequence at the new tokens' positions, and the harness's math in the cell's dtype the same way."""
        from attnbench.correctness.cases import reference

        out = (self.step() if output is None else output)[0].detach().cpu()
        w = zero_held(self.module, random_weights(self.spec, seed=seed, scale="linear").to(dtype=self.x.dtype))

        def ref(weights, dtype, device) -> torch.Tensor:
            return torch.cat([reference(self.x[i, :r.kv][None].to(device=device, dtype=dtype),
                                        weights.to(device=device, dtype=dtype), self.spec)[0, r.cached:].cpu()
                              for i, r in enumerate(self.requests)])

        return out, ref(w, torch.float64, torch.device("cpu")), ref(w, self.x.dtype, self.device)


def mixed_spec(cell: Cell, requests: tuple[Request, ...]) -> AttnSpec:
    """The layer spec of a mixed cell: its sizes and variant, ``context_length`` = the longest request's ``kv``."""
    return AttnSpec(cell.d_model, cell.d_model, max(r.kv for r in requests), 0.0, cell.num_heads,
                    num_kv_heads=cell.num_kv_heads, window=cell.window, causal=cell.causal,
                    **positional_from_text(cell.positional))


def split(requests: tuple[Request, ...]) -> list[tuple[str, list[int]]]:
    """The step's parts: ``prefill`` (from an empty cache) and ``decode`` (over a cache), the empty ones left out."""
    parts = [("prefill", [i for i, r in enumerate(requests) if not r.cached]),
             ("decode", [i for i, r in enumerate(requests) if r.cached])]
    return [(name, rows) for name, rows in parts if rows]


def build_mixed_workload(cell: Cell, seed: int = 0, ready: Ready | None = None) -> MixedWorkload:
    """Build ``cell`` (``batch_spec`` set): the module with the run's weights, every request's tokens drawn from
    ``seed``, and the step's parts (a paged cache's, or a variable-length class's); a class that can run neither
    raises :class:`~attnbench.errors.UnavailableError` (a ``skipped`` row)."""
    impl = registry.get(cell.impl)
    ready = ready_for(impl, cell, ready)
    requests = mixed.parse_batch_spec(cell.batch_spec)
    spec = mixed_spec(cell, requests)
    module = impl.build(spec, weights=random_weights(spec, seed=seed, scale="linear"), ready=ready).eval()
    x = mixed.inputs(requests, cell.d_model, seed).to(device=ready.device, dtype=ready.dtype)
    if getattr(impl, "varlen", False):
        parts, notes = _varlen_parts(module, requests, x), _varlen_notes(module, requests)
        columns: dict = {}
    elif mixed.runs_mixed(module):
        parts, notes, columns = _paged_parts(cell, module, requests, x)
    else:
        raise UnavailableError(f"{cell.impl} {NO_MIXED_STEP}")
    said = f"mixed step {cell.batch_spec} ({mixed.describe(requests)}): " + ", then ".join(
        f"{p.name} part ({len(p.rows)} requests, one call)" for p in parts)
    return MixedWorkload(cell=cell, spec=spec, module=module, x=x, device=ready.device, requests=requests, parts=parts,
                         notes=(said, *notes), columns=columns)


def _paged_parts(cell: Cell, module: nn.Module, requests: tuple[Request, ...], x: torch.Tensor):
    """Each part in a cache of its own (a copy of ``module``): the caches filled, a first step run to size the
    pool, and a restorer that puts the cache back after every step."""
    parts, columns = [], {}
    for name, rows in split(requests):
        own = copy.deepcopy(module)
        base = getattr(own, "_orig_mod", own)
        if callable(getattr(base, "set_page_size", None)):
            base.set_page_size(cell.page_size or mixed.DEFAULT_PAGE_SIZE)
        mine = tuple(requests[i] for i in rows)
        xs = x[rows]
        with torch.no_grad(), cache_state.default_dtype(x.dtype):
            mixed.fill(own, mine, xs)
            mixed.step(own, mine, xs)  # grows the pool to what a step needs, so no timed step allocates pages
            mixed.fill(own, mine, xs)
        width = max(r.q for r in mine)
        part_x = torch.stack([torch.nn.functional.pad(xs[j, r.cached:r.kv], (0, 0, 0, width - r.q))
                              for j, r in enumerate(mine)])  # (requests, longest q, d), built untimed
        lengths = [r.q for r in mine]

        def call(own=own, part_x=part_x, lengths=lengths) -> torch.Tensor:
            return own(part_x, use_cache=True, lengths=lengths)

        with torch.no_grad(), cache_state.default_dtype(x.dtype):
            restore = cache_state.step_restorer(own, call, cell.impl)
        if name == "decode":
            columns = paging.columns(own)
        parts.append(Part(name, list(rows), call, lambda out, lengths=lengths: torch.cat(
            [out[j, :n] for j, n in enumerate(lengths)]), restore=restore))
    page = cell.page_size or mixed.DEFAULT_PAGE_SIZE
    return parts, (f"paged: each part in its own cache of {page}-token pages, put back after every step (untimed)",), \
        columns


def _varlen_parts(module: nn.Module, requests: tuple[Request, ...], x: torch.Tensor) -> list[Part]:
    """A variable-length class's parts: the prefills' tokens in one call; the cached requests' whole sequences in
    another (no cache: their earlier tokens are recomputed), of which the new tokens' outputs are kept."""
    layout, parts = varlen.layout_of(module), []
    for name, rows in split(requests):
        lengths = tuple(requests[i].kv for i in rows)  # a prefill's kv is its q
        packed = torch.cat([x[i, :requests[i].kv] for i in rows])  # (tokens, d)
        batch = varlen.to_layout(packed, lengths, layout)

        def call(batch=batch, lengths=lengths) -> torch.Tensor:
            return module(batch, lengths=lengths)

        def real(out, lengths=lengths, rows=rows) -> torch.Tensor:
            tokens = torch.split(varlen.real_tokens(out, lengths, layout), list(lengths))
            return torch.cat([t[requests[i].cached:] for t, i in zip(tokens, rows, strict=True)])

        parts.append(Part(name, list(rows), call, real))
    return parts


def _varlen_notes(module: nn.Module, requests: tuple[Request, ...]) -> tuple[str, ...]:
    recomputed = sum(r.cached for r in requests)
    said = f"variable-length class, {varlen.layout_of(module)} layout"
    return (f"{said}; no KV cache: the decode part recomputes its {recomputed} cached tokens",) if recomputed \
        else (said,)
