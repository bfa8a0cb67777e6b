"""Issue 38: every measured cell's error against the float64 reference, beside its time.

After a cell is timed (outside the timed loop) the implementation is called once more on the cell's own input, and
its output is compared with :func:`attnbench.correctness.cases.reference` computed in float64 from the same rounded
input and the weights the module computes with (drawn from the run's seed, exactly as the workload loaded them):

* ``error_rel``: ``max|out - ref| / max|ref|`` (the relative max-norm ``attnbench check`` uses);
* ``error_rms``: ``||out - ref|| / ||ref||`` (Frobenius);
* ``error_base``: the ``error_rms`` of the harness's own plain math (the same reference function) run in the cell's
  dtype on the cell's device, on the same input and weights: what this precision costs anyway;
* ``error_ratio = error_rms / max(error_base, floor)``, the floor a multiple of the dtype's unit roundoff
  (:data:`RATIO_FLOOR`: a quarter of it in the low precisions, below any plain-math error seen; 16 units in float64,
  whose plain math on the CPU is the reference itself, error 0, while a correct implementation differs by a few units
  of roundoff). Above about 2 the
  implementation is less accurate than its precision has to be (FlashAttention's tests accept twice the error of a
  naive implementation in the same precision).

``forward+backward`` rows add the worst gradient's errors (``error_grad_*``, over the input and every canonical weight
the layout maps back; the note names the worst), each relative to at least 1% of the largest reference gradient as
``check`` does. ``decode`` rows measure drift: the cache is emptied, the first tokens are prefilled in one call, then
the last ``min(seq_len, DRIFT_STEPS)`` tokens (the decode step's own token last) are decoded one at a time, and the
last step's output is judged against the reference at its position (``error_steps``: how many steps it came after).
A row whose error was not measured says why in ``error_note`` (``--accuracy off``, block or model scope, the
reference predicted not to fit in memory, the pass raising: it starts ``not measured:``); a measured
``forward+backward`` row's note names its worst gradient.

Members of a comparison group share the reference (same shape, dtype, input and weights), so a group pays for one
reference and one plain-math pass, plus one more call of each member.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from attnbench.correctness.cases import reference
from attnbench.plugins import cache_state
from attnbench.results.text import fmt_bytes
from attnbench.runner import stress
from attnbench.runner.budget import available_bytes
from attnbench.weights import CanonicalWeights, adapter_for, export_weights, zero_held

ACCURACY = ("on", "off")
"""``--accuracy`` / ``[measure] accuracy``: measure each ok row's error (``on``, the default) or skip the pass."""
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
"""Half the machine epsilon of each dtype."""
RATIO_FLOOR = {"float64": 16 * UNIT_ROUNDOFF["float64"], **{k: UNIT_ROUNDOFF[k] / 4 for k in ("float32", "bfloat16", "float16")}}
"""The floor of ``error_base`` in ``error_ratio``."""
RATIO_LIMIT = 2.0
"""An ``error_ratio`` above this is worse than the precision has to be (the report and console mark such rows)."""
REFERENCE_SHARE = 0.5
"""The reference pass may use at most this share of the memory available; a cell predicted to need more says so."""
COLUMNS = ("error_rel", "error_rms", "error_base", "error_ratio", "error_grad_rel", "error_grad_rms", "error_grad_base",
           "error_grad_ratio", "error_note", "error_steps")
"""The row columns this pass fills (``phase_accuracy_s`` is its time, a phase of the run)."""
DRIFT_STEPS = 512
"""Decode rows: at most this many single-token steps before the judged one (the tokens before them are prefilled)."""
GRAD_FLOOR = 1e-2
"""Each gradient's error is relative to at least this share of the largest reference gradient (as ``check``)."""


@dataclass
class Reference:
    """The float64 reference of one cell (on the CPU) and the plain math path's errors against it."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    base: tuple[float, float] = (math.nan, math.nan)  # the plain math's (rel, rms) error of the output
    base_grads: dict[str, tuple[float, float]] = field(default_factory=dict)
    floor: float = 0.0  # GRAD_FLOOR x the largest reference gradient


_CACHE: OrderedDict[tuple, Reference] = OrderedDict()
_CACHE_ENTRIES = 2


def errors(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> tuple[float, float]:
    """``(relative max-norm, relative RMS)`` error of ``out`` against ``ref`` in float64; both relative to at least
    ``floor`` (max-norm) and ``floor`` per entry (RMS); ``inf`` for a non-finite or mis-shaped output."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf, math.inf
    diff = out.detach().to(device="cpu", dtype=torch.float64) - ref
    if not bool(torch.isfinite(diff).all()):
        return math.inf, math.inf
    scale_max = max(float(ref.abs().max()), floor, 1e-300)
    scale_rms = max(float(ref.norm()), floor * math.sqrt(ref.numel()), 1e-300)
    return float(diff.abs().max()) / scale_max, float(diff.norm()) / scale_rms


def ratio(error: float, base: float, dtype: str) -> float:
    """``error / max(base, RATIO_FLOOR[dtype])``; NaN when either is missing."""
    if not (math.isfinite(base) and error == error):
        return math.nan
    return error / max(base, RATIO_FLOOR.get(dtype, 0.0), 1e-300)


def reference_bytes(cell) -> float:
    """Memory the reference pass is predicted to need: one head's float64 scores, masked scores and softmax at a time
    (the reference loops over heads), every head's kept for the backward of a ``forward+backward`` row, and the
    activations."""
    tokens = cell.seq_len + (1 if cell.mode == "decode" else 0)
    scores = 8.0 * cell.batch * tokens * tokens
    saved = 2 * cell.num_heads * scores if cell.mode == "forward+backward" else 0.0
    return 3 * scores + saved + 8.0 * cell.batch * tokens * cell.d_model * 16


def why_not(cell, settings) -> str | None:
    """Why this cell's error is not measured (the row's ``error_note``), or None."""
    mode = getattr(settings, "accuracy", "on")
    if mode not in ACCURACY:
        return f"not measured: accuracy = {mode!r} is neither on nor off ([measure] accuracy or --accuracy)"
    if mode == "off":
        return "not measured: --accuracy off"
    if cell.scope != "layer":
        return (f"not measured: {cell.scope} scope has no per-row float64 reference yet (attnbench check --scope "
                f"{cell.scope} compares it with one)")
    if cell.mode not in ("inference", "forward", "forward+backward", "decode"):
        return f"not measured: mode {cell.mode} has no float64 reference"
    need = reference_bytes(cell)
    avail, where = available_bytes(cell.device)
    if need > REFERENCE_SHARE * avail:
        return (f"not measured: the float64 reference is predicted to need {fmt_bytes(need)}, more than "
                f"{REFERENCE_SHARE:.0%} of the {fmt_bytes(avail)} available ({where})")
    return None


def record(built, settings, row: dict, passthrough: tuple[type[BaseException], ...] = ()) -> None:
    """Fill ``row``'s error columns for the measured cell ``built`` (a :class:`attnbench.runner.cell.Built`) and its
    ``phase_accuracy_s``. Exceptions in ``passthrough`` (the cell's timeout) propagate; any other leaves the row's
    timing intact and its ``error_note`` naming the failure."""
    t0 = time.perf_counter()
    try:
        why = why_not(built.cell, settings)
        if why:
            row["error_note"] = why
        else:
            row.update(measure(built.workload, settings.seed, built.output))
            row["error_note"] = row.get("error_note") or ""
    except passthrough:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        row["error_note"] = f"not measured: the accuracy pass raised {type(exc).__name__}: {first}"
    finally:
        built.output = None  # judged: its memory goes back
        row["phase_accuracy_s"] = time.perf_counter() - t0


def measure(workload, seed: int, output: torch.Tensor | None = None) -> dict:
    """The error columns of ``workload`` (built from ``seed``). ``output``: the output of a call already made on the
    cell's input (the first call, which checked it; a ``forward+backward`` call leaves the same gradients as every
    later one); None calls the implementation once more. Decode rows always run their drift steps."""
    cell, dtype = workload.cell, str(workload.x.dtype).removeprefix("torch.")
    if hasattr(workload, "accuracy_parts"):  # issue 37: a variable-length batch, each sequence judged on its own
        out, ref64, low = workload.accuracy_parts(seed, output)
        (rel, rms), base = errors(out, ref64), errors(low, ref64)[1]
        return {"error_rel": rel, "error_rms": rms, "error_base": base, "error_ratio": ratio(rms, base, dtype),
                "error_steps": 0, "error_note": "gradients not compared for variable-length rows"
                if cell.mode == "forward+backward" else ""}
    backward = cell.mode == "forward+backward"
    ref = shared_reference(workload, seed)
    steps = 0
    if cell.mode == "decode":
        out, steps = decode_steps(workload, reference_input(workload, seed))
    elif output is not None:
        out = output
    else:
        with torch.no_grad() if not backward else torch.enable_grad():
            out = workload.step()
    rel, rms = errors(_last_token(out, cell), ref.out)
    cols = {"error_rel": rel, "error_rms": rms, "error_base": ref.base[1], "error_ratio": ratio(rms, ref.base[1], dtype),
            "error_steps": steps}
    if backward:
        cols.update(_grad_columns(implementation_grads(workload, list(ref.grads)), ref, dtype))
    return cols


def shared_reference(workload, seed: int) -> Reference:
    """The cell's :class:`Reference`, computed once for every member of its comparison group that computes with the
    same weights (the same layout's parameters held at zero; a composed layout: its own)."""
    cell, module = workload.cell, workload.module
    composed = _composed(module)
    key = (cell.group_id, seed, str(workload.device), adapter_for(module).held_at_zero, adapter_for(module).held_at,
           cell.impl if composed else "")
    ref = _CACHE.get(key)
    if ref is None:
        weights, _ = reference_weights(workload, seed)
        names = _grad_names(weights, composed) if cell.mode == "forward+backward" else ()
        ref = compute_reference(workload, weights, seed, names=names)
        _CACHE[key] = ref
        while len(_CACHE) > _CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    return ref


def _composed(module) -> bool:
    return bool(getattr(getattr(adapter_for(module), "layout", None), "composed", False))


def reference_weights(workload, seed: int) -> tuple[CanonicalWeights, bool]:
    """The canonical weights the module computes with (the run's draw, rounded to its dtype, the parameters its layout
    lacks held at zero; a composed low-rank layout's own), on the CPU; and whether the layout is composed."""
    module, dtype = workload.module, workload.x.dtype
    composed = _composed(module)
    if composed:
        w = export_weights(module, workload.spec).to(device="cpu", dtype=dtype)
    else:
        w = stress.weights(workload.cell, workload.spec, seed).to(device="cpu", dtype=dtype)
    return zero_held(module, w), composed


def _grad_names(weights: CanonicalWeights, composed: bool) -> tuple[str, ...]:
    """The gradients compared: the input's, and the canonical weights' unless the layout is composed (its weights are
    a product) or the weight is a QK-norm gain (an effective gain, not a parameter)."""
    if composed:
        return ("x",)
    return ("x", *(n for n, _ in weights.items() if not n.startswith("g_")))


def reference_input(workload, seed: int) -> torch.Tensor:
    """The cell's input as the module saw it (its dtype, on the CPU); for decode, the prefill and the decode step's
    token (drawn again from the workload's generator, checked against the prefill it drew first)."""
    x = workload.x.detach().to("cpu")
    if workload.cell.mode != "decode":
        return x
    c = workload.cell
    g = torch.Generator().manual_seed(seed + 1)
    again = stress.stressed_input(c, torch.randn(c.batch, c.seq_len, c.d_model, generator=g), seed).to(x.dtype)
    if not torch.equal(again, x):
        raise RuntimeError("the decode token could not be drawn again: the workload's input no longer comes from "
                           "torch.Generator().manual_seed(seed + 1) (keep attnbench.measure.accuracy.reference_input "
                           "in step with attnbench.runner.workload.build_workload)")
    return torch.cat([x, torch.randn(c.batch, 1, c.d_model, generator=g).to(x.dtype)], dim=1)


def decode_steps(workload, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Empty the module's cache, prefill ``tokens`` but the last ``N = min(DRIFT_STEPS, len - 1)`` in one call, decode
    those ``N`` one token at a time; the last step's output and ``N``. (Run last: the cache then holds one token more
    than the timed steps saw.)"""
    module, x = workload.module, tokens.to(workload.device)
    steps = min(DRIFT_STEPS, x.shape[1] - 1)
    first = x.shape[1] - steps
    with torch.inference_mode(), cache_state.default_dtype(x.dtype):
        cache_state.reset_cache(module)
        module(x[:, :first].contiguous(), use_cache=True)
        for i in range(first, x.shape[1]):
            out = module(x[:, i:i + 1].contiguous(), use_cache=True)
    return out, steps


def _last_token(t: torch.Tensor, cell) -> torch.Tensor:
    """A decode step's output as it is (one token); the reference's last position for a decode cell."""
    return t[:, -1:] if cell.mode == "decode" and t.shape[1] != 1 else t


def compute_reference(workload, weights: CanonicalWeights, seed: int, names: tuple[str, ...] = ()) -> Reference:
    """The float64 reference of the workload's cell (its gradients ``names`` with the workload's output gradient)
    and the plain math path's errors in the cell's dtype on its device."""
    cell, device = workload.cell, workload.device
    x = reference_input(workload, seed)
    grad_out = workload.grad_out.detach().to("cpu") if names else None
    ref_device = device if device.type == "cuda" else torch.device("cpu")
    out64, grads64 = _forward(x.to(ref_device, torch.float64), weights.to(ref_device, torch.float64), workload.spec,
                              grad_out, names)
    ref = Reference(_last_token(out64, cell).cpu(), {n: g.cpu() for n, g in grads64.items()})
    out_low, grads_low = _forward(x.to(device), weights.to(device), workload.spec, grad_out, names)
    ref.base = errors(_last_token(out_low, cell), ref.out)
    ref.floor = GRAD_FLOOR * max((float(g.abs().max()) for g in ref.grads.values()), default=0.0)
    ref.base_grads = {n: errors(g, ref.grads[n], ref.floor) for n, g in grads_low.items()}
    return ref


def _forward(x: torch.Tensor, w: CanonicalWeights, spec, grad_out: torch.Tensor | None,
             names: tuple[str, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference function in the dtype of ``x`` and ``w``; with ``names``, also the gradients of ``<out,
    grad_out>`` with respect to them (``x`` and canonical weight names)."""
    if not names:
        with torch.no_grad():
            return reference(x, w, spec).detach(), {}
    x = x.detach().requires_grad_(True)
    w = w.leaves()
    out = reference(x, w, spec)
    wanted = [x if n == "x" else getattr(w, n) for n in names]
    grads = torch.autograd.grad(out, wanted, grad_out.to(device=out.device, dtype=out.dtype))
    return out.detach(), {n: g.detach() for n, g in zip(names, grads, strict=True)}


def implementation_grads(workload, names: list[str]) -> dict[str, torch.Tensor]:
    """The gradients the last step left: the input's and, mapped back to canonical names by the layout's adapter, the
    weights' (only ``names``; a weight without a gradient is left out and ends up named in the row's note)."""
    grads = {"x": workload.x.grad} if workload.x.grad is not None else {}
    wanted = [n for n in names if n != "x"]
    if not wanted:
        return grads
    base = getattr(workload.module, "_orig_mod", workload.module)
    state = {n: p.grad for n, p in base.named_parameters() if p.grad is not None}
    canonical = adapter_for(workload.module).from_state(state, workload.spec)
    for name in wanted:
        g = getattr(canonical, name, None)
        if g is not None:
            grads[name] = g
    return grads


def _grad_columns(got: dict[str, torch.Tensor], ref: Reference, dtype: str) -> dict:
    """The worst gradient's errors (by RMS error), its plain-math error and their ratio; the note names it and any
    gradient the implementation did not produce."""
    worst, cols = None, {}
    for name, want in ref.grads.items():
        rel, rms = errors(got[name], want, ref.floor) if name in got else (math.inf, math.inf)
        base = ref.base_grads.get(name, (math.nan, math.nan))[1]
        r = ratio(rms, base, dtype)
        if worst is None or (r > worst[3] if r == r else rms > worst[2]):
            worst = (name, rel, rms, r, base)
        cols["error_grad_rel"] = max(cols.get("error_grad_rel", 0.0), rel)
    if worst is None:
        return {}
    cols.update(error_grad_rms=worst[2], error_grad_base=worst[4], error_grad_ratio=worst[3])
    missing = [n for n in ref.grads if n not in got]
    note = f"worst gradient: {worst[0]}" + (f"; no gradient for {', '.join(missing)}" if missing else "")
    return {**cols, "error_note": note}


def merged_columns(rows: list[dict]) -> dict:
    """The error columns of one cell's rows from several rounds: the round that measured them (the first)."""
    for row in rows:
        if row.get("error_note") is not None and row.get("error_note") == row.get("error_note"):
            return {k: row.get(k) for k in COLUMNS}
    return {}
