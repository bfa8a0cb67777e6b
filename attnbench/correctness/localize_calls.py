"""When the line is in a helper, is the helper wrong or the class's call of it? (issue 47).

A helper (a function, or another module's forward) that the class calls for the queries and again for the keys, say
``q = self.rotary(q)`` and ``k = self.rotary(k, offset=1)``, is right when one of its calls gives a stage of the
reference: then the line to name for the call that diverges is that call in the class (an offset, a wrong table or
argument), not the helper's own line, which computes the right thing from what it was given.
"""

from __future__ import annotations

from attnbench.correctness.localize_finding import Evidence
from attnbench.correctness.localize_record import Record


def helper_call(rec: Record, ev: Evidence) -> Record | None:
    """The last record the same helper function as ``rec`` made for another call line of the class (what it gave that
    call), when that equals a stage of the reference; ``None`` when ``rec`` is not in a helper or no other call of it
    gives one."""
    if rec.caller is None or rec.func is None:
        return None
    calls: dict[tuple, Record] = {}
    for other in ev.records:
        if other.func == rec.func and other.caller is not None and other.caller[:2] != rec.caller[:2]:
            calls[other.caller[:2]] = other  # the call's last record: what the helper gave it
    return next((last for last in calls.values() if last.index in ev.explained), None)
