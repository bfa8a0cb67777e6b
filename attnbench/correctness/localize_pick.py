"""Which failing case of an implementation is localised (issue 47): one per kind, never a degenerate one when a
longer case fails.

Localisation runs once per implementation and failing kind, on the case whose intermediates are the sharpest: not
degenerate (:func:`degenerate`: one or two tokens, one feature per head, where several stages are equal), then the
most precise dtype, then the longest. A kind that only errs (a float16-only overflow that raises) is localised on its
erroring case. A kind whose only failing cases are degenerate is left out when another kind of the same
implementation fails on a case that is not: on an unseen set, 4 of 9 wrong lines came from such cases.
"""

from __future__ import annotations

DTYPE_RANK = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3}
"""Which failing case of a kind is localised: the most precise dtype first (its intermediates are the sharpest)."""


BASELINE_JUDGED = ("extreme_logits", "low_precision")
"""Kinds whose tolerance is a multiple of the harness's own error in the dtype, over the output (at extreme scores,
1.6 in float16): no bound on one intermediate, which is compared within its dtype's tolerance instead."""


def degenerate(case) -> bool:
    """A case whose stages cannot be told apart: one or two tokens (one query's weights are all 1, RoPE does nothing
    at position 0, the merged heads equal the values), or one feature per head. Localised only when a kind has no
    other failing case: on an unseen set, 4 of 9 wrong lines came from such cases."""
    if case is None:
        return True
    spec = case.shape.spec
    return case.shape.seq_len < 3 or spec.head_dim < 2


def _hung(row) -> bool:
    """A case that ran past its timeout: never replayed (the replay has no deadline; it would hang ``check`` as long
    as the class does)."""
    return row.status == "error" and str(row.message).startswith("timeout:")


def _pick(rows, known: dict) -> int:
    """The failing row of one kind to localise: not degenerate, then the most precise dtype, then the longest."""
    return min(rows.index, key=lambda j: _rank(rows.loc[j], known))


def _rank(row, known: dict) -> tuple:
    case = known.get((row["kind"], row["shape"], row["dtype"]))
    return degenerate(case), DTYPE_RANK.get(row["dtype"], 9), -(case.shape.seq_len if case else 0)


def targets(bad, known: dict) -> list[tuple[int, bool]]:
    """``(row, is an error)`` to localise: per implementation and kind, its failing row (:func:`_pick`), else, when
    it only errs, its erroring row (a float16-only overflow that raises); never a degenerate case
    (:func:`degenerate`) when a case of another kind of the same implementation that is not degenerate fails."""
    rows = bad[[(r.kind, r.shape, r.dtype) in known and not _hung(r) for r in bad.itertuples()]]
    picked = []
    for (impl_name, _kind), group in rows.groupby(["impl", "kind"], sort=False):
        failed = group[group.status == "fail"]
        picked.append((impl_name, _pick(failed if len(failed) else group, known), failed.empty))
    sharp = {impl for impl, i, erred in picked if not erred and not _rank(rows.loc[i], known)[0]}
    return [(i, erred) for impl, i, erred in picked if impl not in sharp or not _rank(rows.loc[i], known)[0]]
