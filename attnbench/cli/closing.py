"""The closing line's first failure: shared by ``attnbench run`` and its instruction-count path."""

from __future__ import annotations

FAILED = ("error", "timeout", "oom", "invalid")
"""Statuses that are failures (a ``skipped`` cell is not one)."""


def first_failed(df, failed=FAILED):
    """The row the closing line names: the first whose status is in ``failed`` (a failure, not a ``skipped`` cell);
    when there is none, the first row that is not ``ok`` (a run of skipped cells says why one was); else None."""
    for mask in (df.status.isin(failed), df.status != "ok"):
        if mask.any():
            return df[mask].iloc[0]
    return None
