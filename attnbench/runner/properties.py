"""Issue 48: ``deterministic`` and ``batch_invariant`` on a speed row, measured at the cell's own shape and threads.

A user choosing by speed among the implementations that are batch-invariant filters the table by these columns
(``df[df.batch_invariant == "bitwise"]``). Each holds the statement of
:func:`attnbench.correctness.invariance.statement` (``bitwise``, ``within k ulps``, ``differs by X``), or ``""`` when
it was not measured:

* ``deterministic``: the cell's input, :data:`REPEATS` calls under ``no_grad``, each compared with the first;
* ``batch_invariant``: the first and the last sequence of the batch, each alone (batch 1), against their rows of the
  batch's output (a batch of 1 is compared with the same sequence twice in a batch of 2).

They are measured after the timing, with the threads the row was timed with, for layer cells with a rectangular
batch (not decode, variable-length, mixed-step, block or model cells) when the calls cost at most :data:`BUDGET_S` together, and
never for ``compiled:`` cells (a batch of 1 would compile again). The row's notes say when they were not. Like peak
memory and the counted FLOPs, only the first round measures them; the merged row keeps that round's
(:func:`merged_columns`).
"""

from __future__ import annotations

import torch

from attnbench.correctness.invariance import Diff, diff, statement

REPEATS = 5
"""Calls of one input on a speed row: a spot check at the cell's own shape and threads, half of the ten with which
``attnbench check`` states the property (:data:`attnbench.correctness.invariance.REPEATS`); issue 49 halved it to
bring the default run under a minute."""
BUDGET_S = 2.0
"""At most this many seconds (estimated from the cell's median) go to measuring the two properties."""


def why_not(workload, compiled: bool, median_s: float) -> str | None:
    """Why the properties are not measured for this cell, or ``None`` when they are."""
    cell = workload.cell
    if compiled:
        return "a compiled: cell (a batch of 1 would compile again)"
    if cell.mode == "decode" or getattr(cell, "lengths", "") or getattr(cell, "batch_spec", "") \
            or str(getattr(cell, "scope", "layer")) != "layer":
        return "measured for rectangular layer cells only (attnbench check states them for every class)"
    if not isinstance(getattr(workload, "x", None), torch.Tensor) or workload.x.dim() != 3:
        return "no (batch, T, d) input"
    if not median_s == median_s or (REPEATS + 3) * median_s > BUDGET_S:
        return f"{REPEATS + 3} more calls would take over {BUDGET_S:g} s"
    return None


def measure(module, x: torch.Tensor, dtype: str) -> tuple[Diff, Diff]:
    """The largest differences over :data:`REPEATS` calls of ``x`` and over its first and last sequences alone."""
    with torch.no_grad():
        first = module(x).detach().cpu()
        det = Diff()
        for i in range(1, REPEATS):
            det = det.worse(diff(first, module(x).detach().cpu(), dtype, f"call {i + 1}"))
        whole = first if x.shape[0] > 1 else module(torch.cat([x, x])).detach().cpu()
        inv = Diff()
        for row in dict.fromkeys((0, whole.shape[0] - 1)):
            alone = module(x[min(row, x.shape[0] - 1):][:1]).detach().cpu()[0]
            inv = inv.worse(diff(alone, whole[row], dtype, f"row {row}"))
    return det, inv


def columns(workload, compiled: bool, median_s: float) -> tuple[dict, str | None]:
    """``{"deterministic": ..., "batch_invariant": ...}`` for the row, and a note when they were not measured."""
    reason = why_not(workload, compiled, median_s)
    if reason:  # said in the notes only where the cell could have had them
        said = reason.endswith(" s") or reason.startswith("a compiled")
        return {"deterministic": "", "batch_invariant": ""}, (
            f"deterministic / batch_invariant not measured: {reason}" if said else None)
    dtype = str(workload.x.dtype).removeprefix("torch.")
    try:
        det, inv = measure(workload.module, workload.x, dtype)
    except Exception as exc:  # the timed step worked: a property that cannot be measured is a note, not a failure
        return {"deterministic": "", "batch_invariant": ""}, (
            f"deterministic / batch_invariant not measured: {type(exc).__name__}: {str(exc)[:120]}")
    return {"deterministic": statement(det), "batch_invariant": statement(inv)}, None


def merged_columns(rows: list[dict]) -> dict[str, str]:
    """The two columns of one cell's rows from several rounds: the round that measured them (the first; later rounds
    do not measure them again, as they do not measure memory or count FLOPs)."""
    for row in rows:
        if row.get("deterministic") or row.get("batch_invariant"):
            return {k: row.get(k, "") for k in ("deterministic", "batch_invariant")}
    return {"deterministic": "", "batch_invariant": ""}
