"""Issue 48: the properties serving and RL choose an implementation by, measured in every verdict.

Correct within tolerance is not all a user asks: a rollout recomputed for RL must score the same, a served request's
output must not depend on the requests that share its batch, and two identical calls should agree bit for bit. Each
property below is one case kind; it compares the implementation *with itself* (the float64 reference is the other
cases' business) and states the largest difference it saw in one of three forms (:func:`statement`):

* ``bitwise``: every compared output equal bit for bit;
* ``within k ulps``: no element more than ``k`` units in the last place of the output's largest entry apart
  (``k <= ULPS_STATED``; the ulp is the spacing of the case's dtype at that entry: counted element by element, an
  output near zero would read thousands of ulps for a difference of one rounding of the sum it came from);
* ``differs by X``: more than that; ``X`` is the largest difference relative to the output's largest entry.

A property is not a failure: its row passes whatever it reads, unless the class *declares* the property
(``attnbench_properties = ("deterministic", "batch_invariant")`` on the class or its factory) and the measurement
contradicts it: then it fails, naming where. Every message ends with the CPU threads and the torch version it was
measured with (the check runs on one thread: :func:`attnbench.correctness.matrix.run_matrix`).

The kinds, by property (:data:`PROPERTY_OF`):

* ``deterministic``: one input, :data:`REPEATS` calls (``varlen_deterministic``: a variable-length batch);
* ``deterministic_backward``: the input's and every parameter's gradient over :data:`REPEATS` backward passes;
* ``batch_invariant``: one sequence alone, then in batches of :data:`BATCH_SIZES` at the first, a middle and the last
  row, among other sequences (``varlen_batch_invariant``: among sequences of other lengths, so a padded layout pads
  it to other widths and a packed one puts it at other offsets);
* ``chunk_invariant`` (a KV cache): the last position after a prefill in one call, in chunks of
  :data:`CHUNKS` tokens, and token by token;
* ``prefix_reuse`` (a KV cache): a cached prefix of each length in :data:`PREFIXES` plus the rest in one call,
  against the whole sequence in one call, at every position of the suffix;
* ``layout_invariant`` (a paged cache): the same decode with other page sizes and the pool's pages handed out in
  other orders (:data:`PAGE_SIZES`, :data:`PAGE_ORDERS`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from attnbench.correctness.cases import Built, Case, CaseResult, Shape, build, inputs, row, seed_for
from attnbench.devices import DTYPES
from attnbench.plugins import cache_state
from attnbench.runner import varlen as layouts
from attnbench.spec import AttnSpec
from attnbench.weights import random_weights

SHAPE = Shape("invariance", 4, 16, AttnSpec(32, 32, 16, 0.0, 2, True))
"""Batch 4 of 16 tokens, 2 heads of 16: tiny, so ten repeats cost milliseconds."""
VARLEN_SHAPE = Shape("invariance_varlen", 3, 9, AttnSpec(32, 32, 9, 0.0, 2, True))
REPEATS = 10
BATCH_SIZES = (2, 5)
"""Batches the probed sequence sits in (besides alone): at row 0, the middle row and the last row of each."""
CHUNKS = (2, 3, 5)
PREFIXES = (1, 7, 15)
PAGE_SIZES = (16, 4, 3)
PAGE_ORDERS = 3
"""Decodes per page size; a paged cache hands its free pages out in a new random order at each ``reset_cache()``.
The first page size's first decode is the baseline the others are compared with."""
VARLEN_TARGET, VARLEN_BATCHES = 7, ((7, 5, 9), (3, 9, 7, 1, 5), (5, 1, 7))
"""The probed varlen sequence's length, and the batches it sits in (first, in the middle, last; padded widths 9)."""
ULPS_STATED = 16
"""Up to this many ulps (of the output's largest entry) a difference reads ``within k ulps``; beyond, ``differs by X``
(relative to that entry)."""
MANTISSA = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}
DTYPES_OF = {"deterministic": ("float32", "bfloat16"), "batch_invariant": ("float32", "bfloat16")}
"""Kinds measured in more than float32."""
PROPERTY_OF = {"deterministic": "deterministic", "varlen_deterministic": "deterministic",
               "deterministic_backward": "deterministic_backward", "batch_invariant": "batch_invariant",
               "varlen_batch_invariant": "batch_invariant", "chunk_invariant": "chunk_invariant",
               "prefix_reuse": "prefix_reuse", "layout_invariant": "layout_invariant"}
"""Case kind -> the property it measures (the table's column)."""
DECLARABLE = ("deterministic", "deterministic_backward", "batch_invariant", "chunk_invariant", "prefix_reuse",
              "layout_invariant")


@dataclass(frozen=True)
class Diff:
    """The largest difference between compared outputs: absolute, relative to the output's largest entry, in ulps."""

    abs: float = 0.0
    rel: float = 0.0
    ulps: float = 0.0
    where: str = ""

    def worse(self, other: Diff) -> Diff:
        """The larger of two differences (by ulps, then relative)."""
        return other if (other.ulps, other.rel) > (self.ulps, self.rel) else self


def ulp(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|x|`` (float64; normal numbers; the smallest normal's spacing below it)."""
    a = x.detach().double().abs()
    tiny = torch.finfo(DTYPES[dtype]).tiny
    return torch.exp2(torch.floor(torch.log2(a.clamp_min(tiny))) - MANTISSA[dtype])


def diff(a: torch.Tensor, b: torch.Tensor, dtype: str, where: str = "") -> Diff:
    """How far ``b`` is from ``a`` (same shape; NaNs equal where both are NaN): ulps of ``a``'s largest entry."""
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    same = (a64 == b64) | (a64.isnan() & b64.isnan())
    if bool(same.all()):
        return Diff()
    d = float((a64 - b64).abs().masked_fill(same, 0.0).nan_to_num(math.inf).max())
    scale = float(a64.abs().nan_to_num(0.0).max()) or 1.0
    return Diff(d, d / scale, d / float(ulp(torch.tensor(scale), dtype)), where)


def statement(d: Diff) -> str:
    """``bitwise``, ``within k ulps`` or ``differs by X`` (relative to the output's largest entry)."""
    if d.ulps == 0:
        return "bitwise"
    if d.ulps <= ULPS_STATED:
        k = math.ceil(d.ulps)
        return f"within {k} ulp{'s' * (k != 1)}"
    return f"differs by {d.rel:.2g}"


def conditions() -> str:
    """``1 thread, torch 2.x``: what a CPU measurement depends on."""
    n = torch.get_num_threads()
    return f"{n} thread{'s' * (n != 1)}, torch {torch.__version__.split('+')[0]}"


def declared(impl, module) -> tuple[str, ...]:
    """The properties ``impl`` declares (``attnbench_properties`` on its factory, the module or the module's class)."""
    for owner in (getattr(impl, "factory", None), getattr(module, "_orig_mod", module)):
        value = getattr(owner, "attnbench_properties", None)
        if value:
            return (value,) if isinstance(value, str) else tuple(value)
    return ()


def verdict(impl, case: Case, device, module, d: Diff, what: str) -> CaseResult:
    """The property's row: a pass stating it, or a failure when the class declares it and it is not bitwise."""
    prop = PROPERTY_OF[case.kind]
    said = statement(d)
    at = f" (largest at {d.where})" if d.where and d.ulps else ""
    message = f"{said}: {what}{at}; {conditions()}"
    if d.ulps and prop in declared(impl, module):
        return row(impl, case, device, "fail", d.rel, 0.0, f"declares {prop} but {message}")
    return row(impl, case, device, "pass", d.rel, None, message)


def read(message: str) -> dict:
    """A property row's message as fields: ``statement``, ``ulps`` (None unless within k ulps), ``differs_by`` and
    ``threads`` (the inverse of :func:`verdict`'s message)."""
    text = message.removeprefix("declares ").split(" but ", 1)[-1] if message.startswith("declares ") else message
    head = text.split(":", 1)[0]
    m_ulps = re.fullmatch(r"within (\d+) ulps?", head)
    m_diff = re.fullmatch(r"differs by (\S+)", head)
    m_thr = re.search(r"; (\d+) threads?, torch ", text)
    return {"statement": "bitwise" if head == "bitwise" else "ulps" if m_ulps else "differs" if m_diff else head,
            "text": head, "ulps": int(m_ulps.group(1)) if m_ulps else (0 if head == "bitwise" else None),
            "differs_by": float(m_diff.group(1)) if m_diff else None,
            "threads": int(m_thr.group(1)) if m_thr else None}


def cases() -> list[Case]:
    """The property cases, in the order they run."""
    out = [Case(kind, SHAPE, dtype) for kind in ("deterministic", "batch_invariant") for dtype in DTYPES_OF[kind]]
    out += [Case(kind, SHAPE, "float32") for kind in ("deterministic_backward", "chunk_invariant", "prefix_reuse",
                                                        "layout_invariant")]
    out += [Case(kind, VARLEN_SHAPE, "float32") for kind in ("varlen_deterministic", "varlen_batch_invariant")]
    return out


def _built(impl, case: Case, device) -> Built:
    spec = case.shape.spec
    return build(impl, spec, device, case.dtype, random_weights(spec, seed=seed_for(case.shape)))


def _x(case: Case, batch: int | None = None, seed: int = 1) -> torch.Tensor:
    return inputs(case.shape, batch=batch, seed=seed).to(DTYPES[case.dtype])


# --- determinism ----------------------------------------------------------------------------------

def run_deterministic(impl, case: Case, device: torch.device) -> CaseResult:
    """One input, :data:`REPEATS` eval calls, each compared with the first."""
    built, x = _built(impl, case, device), _x(case).to(device)
    worst = Diff()
    with torch.no_grad():
        first = built.module(x).cpu()
        for i in range(1, REPEATS):
            worst = worst.worse(diff(first, built.module(x).cpu(), case.dtype, f"call {i + 1}"))
    return verdict(impl, case, device, built.module, worst, f"{REPEATS} calls of one input "
                   f"(batch {case.shape.batch}, T={case.shape.seq_len})")


def _grads(module, x: torch.Tensor, g: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, gradient)`` of ``<module(x), g>`` for the input and every trainable parameter."""
    leaf = x.clone().requires_grad_(True)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(module(leaf), [leaf] + [p for _, p in params], grad_outputs=g, allow_unused=True)
    return [(n, t.detach().cpu()) for n, t in zip(["x"] + [n for n, _ in params], got, strict=True) if t is not None]


def run_deterministic_backward(impl, case: Case, device: torch.device) -> CaseResult:
    """:data:`REPEATS` backward passes of one input and ``grad_output``: every gradient compared with the first's."""
    built, x = _built(impl, case, device), _x(case).to(device)
    gen = torch.Generator().manual_seed(seed_for(case.shape) + 2)
    g = torch.randn(case.shape.batch, case.shape.seq_len, case.shape.spec.d_out, generator=gen)
    g = g.to(device=device, dtype=x.dtype)
    module = built.module.train()  # dropout 0: the eval function, with autograd recording
    first = _grads(module, x, g)
    worst = Diff()
    for i in range(1, REPEATS):
        for (name, a), (_, b) in zip(first, _grads(module, x, g), strict=True):
            worst = worst.worse(diff(a, b, case.dtype, f"grad {name}, pass {i + 1}"))
    return verdict(impl, case, device, module, worst, f"{REPEATS} backward passes, gradients of the input and "
                   f"{len(first) - 1} parameters")


# --- batch invariance -----------------------------------------------------------------------------

def _placements() -> Iterator[tuple[int, int]]:
    """``(batch, row)``: the probed sequence at the first, a middle and the last row of each batch size."""
    for b in BATCH_SIZES:
        yield from ((b, r) for r in dict.fromkeys((0, b // 2, b - 1)))


def run_batch_invariant(impl, case: Case, device: torch.device) -> CaseResult:
    """One sequence alone, then at every placement of :func:`_placements` among other sequences."""
    built = _built(impl, case, device)
    target = _x(case, batch=1)  # (1, T, d_in)
    others = _x(case, batch=max(BATCH_SIZES), seed=2)
    worst, n = Diff(), 0
    with torch.no_grad():
        alone = built.module(target.to(device)).cpu()[0]
        for b, r in _placements():
            batch = torch.cat([others[:r], target, others[r:b - 1]]).to(device)  # (b, T, d_in)
            worst = worst.worse(diff(alone, built.module(batch).cpu()[r], case.dtype, f"row {r} of a batch of {b}"))
            n += 1
    sizes = "/".join(map(str, BATCH_SIZES))
    return verdict(impl, case, device, built.module, worst, f"a sequence alone vs at {n} rows of batches of {sizes}")


# --- with a KV cache ------------------------------------------------------------------------------

def _cached(module, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``reset_cache()``, then ``x``'s tokens through the cache in calls of ``sizes`` tokens: each call's output."""
    outs, t = [], 0
    with torch.no_grad(), cache_state.default_dtype(x.dtype):
        cache_state.reset_cache(module)
        for n in sizes:
            outs.append(module(x[:, t:t + n].contiguous(), use_cache=True).cpu())
            t += n
    return outs


def _split(total: int, first: int, size: int) -> list[int]:
    """``first`` tokens, then calls of ``size`` tokens (the last one shorter) up to ``total``."""
    rest = total - first
    return [first] + [size] * (rest // size) + ([rest % size] if rest % size else [])


def run_chunk_invariant(impl, case: Case, device: torch.device) -> CaseResult:
    """The last position after one prefill call, after chunks of :data:`CHUNKS` tokens, and token by token."""
    built, x = _built(impl, case, device), _x(case).to(device)
    T = case.shape.seq_len
    whole = _cached(built.module, x, [T])[-1][:, -1]
    worst = Diff()
    for size in (*CHUNKS, 1):
        last = _cached(built.module, x, _split(T, size, size))[-1][:, -1]
        worst = worst.worse(diff(whole, last, case.dtype, "token by token" if size == 1 else f"chunks of {size}"))
    return verdict(impl, case, device, built.module, worst, f"T={T} in one call vs in chunks of "
                   f"{'/'.join(map(str, CHUNKS))} and token by token, at the last position")


def run_prefix_reuse(impl, case: Case, device: torch.device) -> CaseResult:
    """A cached prefix of each :data:`PREFIXES` length plus the rest in one call vs the whole sequence in one call."""
    built, x = _built(impl, case, device), _x(case).to(device)
    T = case.shape.seq_len
    whole = _cached(built.module, x, [T])[-1]
    worst = Diff()
    for p in PREFIXES:
        suffix = _cached(built.module, x, [p, T - p])[-1]
        worst = worst.worse(diff(whole[:, p:], suffix, case.dtype, f"prefix of {p}"))
    return verdict(impl, case, device, built.module, worst, f"a cached prefix of {'/'.join(map(str, PREFIXES))} "
                   f"tokens plus the rest vs all {T} in one call, every suffix position")


def run_layout_invariant(impl, case: Case, device: torch.device) -> CaseResult:
    """A paged cache: one decode (a prefill, then single tokens) at every page size and page order, compared with
    the first; a contiguous cache skips (no pages to lay out)."""
    from attnbench.correctness.paged import is_paged

    built, x = _built(impl, case, device), _x(case).to(device)
    if not is_paged(built.module):
        return row(impl, case, device, "skip", None, None, "not a paged cache (no set_page_size(n))")
    base = getattr(built.module, "_orig_mod", built.module)
    T, prefill = case.shape.seq_len, case.shape.seq_len // 2
    outs = {}
    for size in PAGE_SIZES:
        base.set_page_size(size)
        for order in range(PAGE_ORDERS):  # each reset_cache() hands the pool's pages out in a new order
            outs[(size, order)] = torch.cat(_cached(built.module, x, [prefill] + [1] * (T - prefill)), dim=1)
    first = next(iter(outs))
    worst = Diff()
    for (size, order), out in outs.items():
        worst = worst.worse(diff(outs[first], out, case.dtype, f"page size {size}, page order {order + 1}"))
    return verdict(impl, case, device, built.module, worst, f"a prefill of {prefill} then single tokens at page sizes "
                   f"{'/'.join(map(str, PAGE_SIZES))} x {PAGE_ORDERS} page orders, every position")


# --- variable-length batches ----------------------------------------------------------------------

def _varlen_call(built: Built, case: Case, device, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``seqs`` (each ``(n, d_in)``) as one batch in the module's layout (padding drawn at random): each one's output."""
    lengths = [len(s) for s in seqs]
    layout = layouts.layout_of(built.module)
    g = torch.Generator().manual_seed(len(lengths))
    pad = torch.randn(len(lengths), max(lengths), case.shape.spec.d_in, generator=g).to(seqs[0].dtype)
    x = layouts.to_layout(torch.cat(seqs), lengths, layout, pad).to(device)
    with torch.no_grad():
        out = built.module(x, lengths=lengths)
    return list(torch.split(layouts.real_tokens(out.detach().cpu(), lengths, layout), lengths))


def _varlen_seqs(case: Case, lengths) -> list[torch.Tensor]:
    """Sequences of ``lengths`` (each ``(n, d_in)``) in the case's dtype; the same length gives the same sequence."""
    x = _x(case, batch=max(VARLEN_TARGET, *lengths), seed=3)
    return [x[n - 1, :n] for n in lengths]


def run_varlen_deterministic(impl, case: Case, device: torch.device) -> CaseResult:
    """One variable-length batch (:data:`VARLEN_BATCHES`'s second), :data:`REPEATS` calls, compared with the first."""
    built, lengths = _built(impl, case, device), VARLEN_BATCHES[1]
    seqs = _varlen_seqs(case, lengths)
    first = torch.cat(_varlen_call(built, case, device, seqs))
    worst = Diff()
    for i in range(1, REPEATS):
        worst = worst.worse(diff(first, torch.cat(_varlen_call(built, case, device, seqs)), case.dtype, f"call {i + 1}"))
    return verdict(impl, case, device, built.module, worst, f"{REPEATS} calls of one batch of lengths "
                   f"{'/'.join(map(str, lengths))} ({layouts.layout_of(built.module)} layout)")


def run_varlen_batch_invariant(impl, case: Case, device: torch.device) -> CaseResult:
    """A sequence of :data:`VARLEN_TARGET` tokens alone, then first, in the middle and last of :data:`VARLEN_BATCHES`."""
    built = _built(impl, case, device)
    alone = _varlen_call(built, case, device, _varlen_seqs(case, [VARLEN_TARGET]))[0]
    worst = Diff()
    for lengths in VARLEN_BATCHES:
        i = lengths.index(VARLEN_TARGET)
        out = _varlen_call(built, case, device, _varlen_seqs(case, lengths))[i]
        worst = worst.worse(diff(alone, out, case.dtype, f"sequence {i} of lengths {'/'.join(map(str, lengths))}"))
    return verdict(impl, case, device, built.module, worst, f"a sequence of {VARLEN_TARGET} alone vs first, in the "
                   f"middle and last of {len(VARLEN_BATCHES)} batches ({layouts.layout_of(built.module)} layout)")


RUNNERS: dict[str, Callable[..., CaseResult]] = {
    "deterministic": run_deterministic, "batch_invariant": run_batch_invariant,
    "deterministic_backward": run_deterministic_backward, "chunk_invariant": run_chunk_invariant,
    "prefix_reuse": run_prefix_reuse, "layout_invariant": run_layout_invariant,
    "varlen_deterministic": run_varlen_deterministic, "varlen_batch_invariant": run_varlen_batch_invariant,
}
"""Case kind -> runner; :mod:`attnbench.correctness.matrix` runs them with the other kinds."""
CASE_MODES = {"deterministic_backward": "forward+backward", "chunk_invariant": "decode", "prefix_reuse": "decode",
              "layout_invariant": "decode"}
CASE_LENGTHS = {"varlen_deterministic": "case", "varlen_batch_invariant": "case"}
"""Kinds that take variable-length implementations only (:data:`attnbench.correctness.varlen.CASE_LENGTHS`)."""


# --- the properties of a check's results ------------------------------------------------------------

def properties(results) -> list[dict]:
    """One record per measured property row of ``results`` (:func:`~attnbench.correctness.matrix.run_matrix`'s
    DataFrame): ``impl``, ``property``, ``kind``, ``dtype``, ``device``, ``declared``, ``holds`` (bitwise) and the
    fields of :func:`read`."""
    out = []
    for r in results.itertuples():
        if r.kind not in PROPERTY_OF or r.status not in ("pass", "fail") or r.error is None:
            continue
        fields = read(r.message)
        out.append({"impl": r.impl, "property": PROPERTY_OF[r.kind], "kind": r.kind, "dtype": r.dtype,
                    "device": r.device, "declared": r.message.startswith("declares "),
                    "holds": fields["statement"] == "bitwise", "max_relative_difference": float(r.error), **fields})
    return out


def summary_lines(results) -> list[str]:
    """``sdpa properties (1 thread, torch 2.6): deterministic float32 bitwise, ...``: one line per implementation."""
    lines = []
    by_impl: dict[str, list[dict]] = {}
    for p in properties(results):
        by_impl.setdefault(p["impl"], []).append(p)
    for impl, props in by_impl.items():
        threads = {p["threads"] for p in props}
        said = "; ".join(f"{p['property']} {p['dtype']} {p['text']}" for p in props)
        lines.append(f"{impl} properties ({', '.join(f'{t} thread' + 's' * (t != 1) for t in sorted(threads, key=str))}, "
                     f"torch {torch.__version__.split('+')[0]}): {said}")
    return lines
