"""The correctness matrix: every implementation, loaded with the same canonical weights, against float64.

Cases (one :class:`Case` each) cover outputs in every dtype, gradients with respect to the input and
every canonical parameter, shapes that expose real bugs (batch 1, T = 1, odd T, T < context_length,
one head and several, head_dim 1 and 64, d_in != d_out, biases on and off) and properties (causality,
batch independence, eval-mode determinism with dropout > 0, dropout active in train mode), plus the
book's golden values for the book's own classes (runners in :mod:`attnbench.correctness.basic`). Variant
shapes (GQA, MQA, sliding windows, non-causal) run where an implementation declares the variant and are
skipped with the reason elsewhere; ``decode`` cases check KV-cache decoding patterns against the full
forward (:mod:`attnbench.correctness.decode`). The round-2 properties (extreme logits, long T, dropout
statistics, strided inputs, side effects, shape sequences, low precision) are in
:mod:`attnbench.correctness.properties`; RoPE, QK-norm, score scale and soft-capping in
:mod:`attnbench.correctness.positional`. This module builds :data:`RUNNERS` from those three modules'
tables; none of them imports this one.

Errors are *relative max-norm* errors: ``max|out - ref| / max|ref|``, compared with a tolerance per
dtype. Low-precision cases compare against a reference computed from the same rounded inputs and
weights, so only the implementation's arithmetic is judged; every reference uses the weights the module
really has (:func:`attnbench.correctness.cases.build`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace

import pandas as pd
import torch

from attnbench import registry
from attnbench.correctness import (
    basic,
    decode,
    invariance,
    mask_cases,
    mixed,
    mla_cases,
    paged,
    positional,
    precision,
    properties,
    varlen,
    watchdog,
)
from attnbench.correctness.cases import (  # noqa: F401  (re-exported: the matrix's public names)
    GRAD_TOLERANCE,
    SEED,
    TOLERANCE,
    Case,
    CaseResult,
    Shape,
    reference,
    rel_error,
)
from attnbench.correctness.decode import DECODE_PREFILL, DECODE_SHAPES  # noqa: F401  (re-exported)
from attnbench.devices import parse_device
from attnbench.errors import AttnbenchError, SweepError, UnavailableError
from attnbench.plugins.exits import plugin_exits
from attnbench.resolve import Skip, resolve
from attnbench.spec import AttnSpec

SHAPES = [
    Shape("book_hd1", 2, 6, AttnSpec(3, 2, 6, 0.0, 2)),  # head_dim 1, d_in != d_out, T == context_length
    Shape("b1_T1", 1, 1, AttnSpec(8, 8, 4, 0.0, 2)),  # batch 1, a single token
    Shape("oddT_din_ne_dout", 3, 7, AttnSpec(12, 16, 10, 0.0, 4)),  # odd T < context_length, d_in != d_out
    Shape("one_head_bias", 2, 5, AttnSpec(16, 16, 8, 0.0, 1, True)),  # one head, q/k/v biases
    Shape("hd64_bias", 2, 9, AttnSpec(32, 128, 16, 0.0, 2, True)),  # head_dim 64, wide output
    Shape("narrow_out", 2, 8, AttnSpec(24, 8, 8, 0.0, 4, True)),  # d_in > d_out, head_dim 2
    Shape("gpt_like", 1, 33, AttnSpec(64, 64, 48, 0.0, 4)),  # d_in == d_out, longer T
    Shape("hd64_square", 2, 17, AttnSpec(128, 128, 24, 0.0, 2)),  # head_dim 64 with d_in == d_out
]
LOW_PRECISION_SHAPES = ("oddT_din_ne_dout", "hd64_bias", "gpt_like", "hd64_square")
PROPERTY_SHAPE = Shape("props", 3, 11, AttnSpec(24, 24, 16, 0.0, 3, True))  # d_in == d_out: every impl runs it
MQA_SHAPE = Shape("mqa", 2, 9, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=1))
"""Four query heads on one kv head, ``d_in == d_out``: a variant shape (forward, backward), and the spec a class that
is multi-query by construction runs the property shape's cases at (:func:`multi_query_case`)."""
DROPOUT = basic.DROPOUT
VARIANT_SHAPES = [  # run by implementations that declare the variant, skipped with the reason by the others
    Shape("gqa", 2, 9, AttnSpec(32, 32, 12, 0.0, 4, True, num_kv_heads=2)),  # 2 query heads per kv head
    Shape("mqa_din_ne_dout", 2, 7, AttnSpec(24, 16, 8, 0.0, 4, num_kv_heads=1)),  # one kv head
    MQA_SHAPE,  # one kv head at one width: what a class multi-query by construction (and same-width) runs
    Shape("window", 2, 13, AttnSpec(16, 16, 16, 0.0, 2, window=4)),  # T > window
    Shape("gqa_window_bias", 1, 17, AttnSpec(32, 32, 20, 0.0, 4, True, num_kv_heads=2, window=5)),
    Shape("window1", 2, 6, AttnSpec(8, 8, 6, 0.0, 2, window=1)),  # each token sees only itself
    Shape("noncausal", 2, 9, AttnSpec(16, 16, 12, 0.0, 2, causal=False)),
    Shape("noncausal_mqa_window", 2, 10, AttnSpec(16, 16, 12, 0.0, 4, num_kv_heads=1, window=3, causal=False)),
]


def shape_specs() -> dict[str, AttnSpec]:
    """Every shape id of the matrix and its spec (for what ``check -v`` says was exercised)."""
    shapes = (SHAPES + VARIANT_SHAPES + DECODE_SHAPES + paged.PAGED_SHAPES + positional.POSITIONAL_SHAPES
              + positional.START_SHAPES + mask_cases.MASK_SHAPES + varlen.VARLEN_SHAPES + mla_cases.MLA_SHAPES
              + [invariance.SHAPE, invariance.VARLEN_SHAPE] + mixed.MIXED_SHAPES)
    return {s.id: s.spec for s in shapes}


def cases(kinds: Iterable[str] | None = None) -> list[Case]:
    """Every case of the matrix (optionally only ``kinds``; an unknown kind is a :class:`SweepError`)."""
    if kinds is not None:
        kinds = list(kinds)
        unknown = [k for k in kinds if k not in RUNNERS]
        if unknown:
            raise SweepError(f"unknown check kind(s) {unknown}; use {', '.join(RUNNERS)}")
    out: list[Case] = []
    for shape in SHAPES:
        for dtype in ("float64", "float32"):
            out.append(Case("forward", shape, dtype))
            out.append(Case("backward", shape, dtype))
        if shape.id in LOW_PRECISION_SHAPES:
            out += [Case("forward", shape, "bfloat16"), Case("forward", shape, "float16")]
    for shape in VARIANT_SHAPES:
        out += [Case("forward", shape, "float64"), Case("forward", shape, "float32"), Case("backward", shape, "float64")]
    out += [Case("decode", shape, dtype) for shape in DECODE_SHAPES for dtype in ("float64", "float32")]
    out += [Case("paged_decode", shape, dtype) for shape in paged.PAGED_SHAPES for dtype in ("float64", "float32")]
    out += [Case("causality", PROPERTY_SHAPE, "float64"), Case("batch_independence", PROPERTY_SHAPE, "float64"),
            Case("eval_deterministic", PROPERTY_SHAPE, "float64"), Case("dropout_train", PROPERTY_SHAPE, "float32"),
            Case("golden", SHAPES[0], "float32")]
    out += properties.cases()
    out += positional.cases()
    out += mask_cases.cases()  # issue 37: ALiBi, prefix-LM, documents, sinks
    out += varlen.cases()  # issue 37
    out += mla_cases.cases()  # issue 46: DeepSeek-style MLA (forward, backward; its decode shapes are decode's)
    out += invariance.cases()  # issue 48: determinism, batch/chunk/layout invariance (stated, not judged)
    out += mixed.cases()  # issue 48: the mixed prefill + decode serving step (paged caches)
    return [c for c in out if kinds is None or c.kind in set(kinds)]


RUNNERS: dict[str, Callable[[registry.Implementation, Case, torch.device], CaseResult]] = {
    **basic.RUNNERS, "decode": decode.run_decode, "paged_decode": paged.run_paged_decode, **properties.RUNNERS,
    **positional.RUNNERS, **varlen.RUNNERS, **invariance.RUNNERS, **mixed.RUNNERS}
"""Case kind -> runner: the plain kinds, the decode property, the round-2 properties, then the start positions."""
CASE_MODES = {**basic.CASE_MODES, "decode": "decode", "paged_decode": "decode", **properties.CASE_MODES, **positional.CASE_MODES,
              **invariance.CASE_MODES, **mixed.CASE_MODES}
"""How each case kind calls the module, for :func:`attnbench.resolve.resolve` (the others: ``inference``)."""
CASE_LENGTHS = {**varlen.CASE_LENGTHS, **invariance.CASE_LENGTHS}
"""Kinds that take variable-length implementations only (issues 37, 48)."""
CASE_DROPOUT = {**basic.CASE_DROPOUT, **properties.CASE_DROPOUT}
"""The dropout each case kind builds with (the others: none)."""

def multi_query_case(impl, case: Case) -> Case:
    """``case`` as ``impl`` runs it: a class multi-query by construction (one kv head whatever it is built with) cannot
    take the property shape's three kv heads, so its causality, batch-independence and dropout cases run at
    :data:`MQA_SHAPE`'s spec (the case keeps its id, so its rerun command selects it)."""
    if case.shape.id == PROPERTY_SHAPE.id and getattr(getattr(impl, "factory", None), "own", {}).get("kv_heads") == 1:
        return replace(case, shape=replace(MQA_SHAPE, id=PROPERTY_SHAPE.id))
    return case


def run_case(impl: registry.Implementation | str, case: Case, device: str = "cpu", seed: int = 0) -> CaseResult:
    """Run one case (weights and inputs drawn from ``seed``); a skip when the implementation declares it
    cannot, an ``error`` row when it raises."""
    impl = registry.get(impl) if isinstance(impl, str) else impl
    case = multi_query_case(impl, case)
    shape = case.shape
    outcome = resolve(impl, shape.spec, device=device, dtype=case.dtype, mode=CASE_MODES.get(case.kind, "inference"),
                      batch=shape.batch, seq_len=shape.seq_len, dropout=CASE_DROPOUT.get(case.kind, 0.0),
                      lengths=CASE_LENGTHS.get(case.kind, ""))  # issue 37: varlen cases take varlen impls only
    if isinstance(outcome, Skip):
        return CaseResult(impl.name, case.kind, shape.id, case.dtype, device, "skip", None, None, outcome.reason)
    dev = outcome.device
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    seed_token, working_token = SEED.set(seed), precision.WORKING.set(None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with plugin_exits(impl.name):
                return RUNNERS[case.kind](impl, case, dev)
    except UnavailableError as exc:  # found only once built (a plug-in's nn.MultiheadAttention needs d_in == d_out)
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(dev), "skip", None, None, str(exc))
    except AttnbenchError as exc:
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(dev), "error", None, None,
                          f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # the implementation under test raised: a failed case, with its message
        hint = (" (no backward here? declare it in attnbench_capabilities: docs/own-attention.md, Capabilities)"
                if case.kind == "backward" else "")
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, str(dev), "error", None, None,
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300] + hint)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        SEED.reset(seed_token)
        precision.WORKING.reset(working_token)


def case_line(result) -> str:
    """``FAIL  impl kind shape dtype: message``: how ``attnbench check`` and the pytest plug-in name a case's verdict
    (``result``: a :class:`CaseResult` or a row of :func:`run_matrix`'s DataFrame)."""
    return f"{result.status.upper():5} {result.impl} {result.kind} {result.shape} {result.dtype}: {result.message}"


def run_matrix(impls: Iterable[str] | None = None, device: str = "cpu", kinds: Iterable[str] | None = None,
               progress: Callable[[CaseResult], None] | None = None, seed: int = 0,
               case_timeout_s: float | str | None = "auto", only: Callable[[Case], bool] | None = None) -> pd.DataFrame:
    """Run every case for ``impls`` (default: all registered and available on ``device``) as a DataFrame.

    ``seed`` draws other weights and inputs for every case (0, the default, is the fixed matrix).
    ``case_timeout_s`` bounds each case (:mod:`attnbench.correctness.watchdog`; ``"auto"``: its default, None: no
    bound): a case past it is an ``error`` whose message starts ``timeout:``, and that implementation's later cases
    are skipped (it hung once). ``only``: run only the cases it accepts (``check --shape/--dtype``, issue 47).

    Unknown names raise :class:`~attnbench.errors.UnknownImplementationError` before anything runs.
    """
    device = str(parse_device(device))  # once: "cuda" -> "cuda:0", and a missing device fails before anything runs
    resolved = [registry.get(n) for n in (list(impls) if impls else registry.available(device))]
    selected = [c for c in cases(kinds) if only is None or only(c)]
    rows = []
    # The check's tensors are tiny: one CPU thread is as fast, and far faster on a busy machine where
    # several spinning OpenMP threads wait on each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for impl in resolved:
            hung, order = None, None
            for case in selected:
                if hung:
                    result = _not_run(impl, case, device, hung)
                else:
                    result = _timed_case(impl, case, device, seed, case_timeout_s)
                    hung = result.message if result.message.startswith("timeout:") else None
                if order is None and _grouped(case):
                    order = _kv_order(impl)
                rows.append(asdict(_noted(result, case, order or "")))
                if progress:
                    progress(result)
    finally:
        torch.set_num_threads(threads)
    return pd.DataFrame(rows, columns=[f for f in CaseResult.__dataclass_fields__])


def _grouped(case: Case) -> bool:
    """Whether ``case`` is grouped-query: more than one kv head, fewer than the query heads."""
    spec = case.shape.spec
    return 1 < (spec.num_kv_heads or spec.num_heads) < spec.num_heads


def _kv_order(impl: registry.Implementation) -> str:
    """The strided kv order's note (:data:`~attnbench.plugins.layout.KV_ORDER_NOTE`) when ``impl`` is a plug-in whose
    query heads read their kv heads strided, else ``""`` (measured once per implementation, at its first grouped
    case)."""
    from attnbench.plugins.layout import groups_line

    lines = groups_line(impl, "float32" if "float32" in impl.dtypes else impl.dtypes[0])
    return lines[0] if lines else ""


def _noted(result: CaseResult, case: Case, note: str) -> CaseResult:
    """``result`` with the kv-order note on its message when ``case`` is grouped-query (the note is a finding, not a
    failure: the case's status stays)."""
    if not note or not _grouped(case):
        return result
    return replace(result, message=f"{result.message}; {note}" if result.message else note)


def _timed_case(impl: registry.Implementation, case: Case, device: str, seed: int, timeout) -> CaseResult:
    """:func:`run_case` under the case's deadline; past it, an ``error`` case naming the timeout."""
    seconds = watchdog.default_for(impl.name) if timeout == "auto" else timeout
    try:
        with watchdog.case_deadline(seconds, f"{case.kind} {case.shape.id} {case.dtype}"):
            return run_case(impl, case, device, seed)
    except watchdog.CaseTimeout as exc:
        return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, device, "error", None, None, str(exc))


def _not_run(impl: registry.Implementation, case: Case, device: str, why: str) -> CaseResult:
    return CaseResult(impl.name, case.kind, case.shape.id, case.dtype, device, "skip", None, None,
                      f"not run: an earlier case of {impl.name} hung ({why})")


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """One row per implementation, kind and dtype: counts of pass/fail/error/skip and the worst error."""
    counts = ["cases", "passed", "failed", "errors", "skipped"]
    if results.empty:
        return pd.DataFrame(columns=["impl", "kind", "dtype", *counts, "worst_error", "tolerance"])
    def agg(g: pd.DataFrame) -> pd.Series:
        err = g["error"].astype(float)
        return pd.Series({
            "cases": len(g), "passed": int((g.status == "pass").sum()), "failed": int((g.status == "fail").sum()),
            "errors": int((g.status == "error").sum()), "skipped": int((g.status == "skip").sum()),
            "worst_error": float(err.max()) if err.notna().any() else float("nan"),
            "tolerance": float(g["tolerance"].astype(float).max()) if g["tolerance"].notna().any() else float("nan"),
        })

    out = results.groupby(["impl", "kind", "dtype"], sort=False)[list(results.columns)].apply(agg).reset_index()
    return out.astype({c: int for c in counts})
