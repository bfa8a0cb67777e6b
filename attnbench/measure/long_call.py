"""Long calls: a call that lasts seconds is known without repetition (issue 39).

A call of at least :data:`LONG_CALL_S` (a whole generation without a cache, say) averages the machine's short-term
noise over its own length; what is left between two such calls is the between-run drift, which every interval
carries anyway (:mod:`attnbench.measure.drift`). So its warm-up is one call (a cell's first call, made when it was
built and checked, already is one, unless it compiled), and its timed calls stop as soon as one agrees with the call
before it (the first call's, for the first) within :data:`LONG_CALL_AGREE`, or after :data:`LONG_CALL_TIMED` timed
calls whatever they say: their spread is then in the row's interval, and its note says so. The same rule runs in a
cell timed alone (:func:`attnbench.measure.timing.time_fn`) and in a comparison group
(:func:`attnbench.measure.interleave.time_interleaved`); a long member's attention share comes from its first call
(:meth:`attnbench.models.workload.ScopeWorkload.first_call`). Before this rule, ``--preset gpt2-124m-generate
--threads 1`` repeated a 90-second generation for warm-up, samples, cycles and the share pass, and ran for over
40 minutes.
"""

from __future__ import annotations

from collections.abc import Sequence

LONG_CALL_S = 10.0
"""A call at least this long is a long call."""
LONG_CALL_AGREE = 0.05
"""Two long calls within this fraction of each other: the call's time is known."""
LONG_CALL_TIMED = 2
"""At most this many timed calls of a long call. A third would cost another long call to tell what the interval's
between-run term already says; the row's samples keep the two, and its note how far apart they were."""


def is_long(call_s: float | None) -> bool:
    """Whether a call of ``call_s`` seconds is a long call."""
    return call_s is not None and call_s >= LONG_CALL_S


def known(first_s: float | None, timed: Sequence[float]) -> bool:
    """Whether a member whose warm-up (or first) call took ``first_s`` is known from its ``timed`` calls: a long call
    whose last timed call agrees with the call before it, or that has had :data:`LONG_CALL_TIMED` timed calls."""
    if not is_long(first_s) or not timed:
        return False
    return len(timed) >= LONG_CALL_TIMED or _gap(first_s, timed) <= LONG_CALL_AGREE


def note(first_s: float, timed: Sequence[float]) -> str:
    """What a long call's row says about why its timing stopped."""
    gap = _gap(first_s, timed)
    before = "the warm-up call" if len(timed) == 1 else "the timed call before it"
    head = (f"a long call ({timed[-1]:.1f} s >= {LONG_CALL_S:.0f} s): warmed up once, {len(timed)} timed call(s), the "
            f"last {gap:.1%} from {before}")
    if gap <= LONG_CALL_AGREE:
        return f"{head} (within {LONG_CALL_AGREE:.0%}: known, no more repetition)"
    return (f"{head}: stopped at {LONG_CALL_TIMED} timed calls all the same (another would cost as much again; the "
            "interval carries their spread)")


def _gap(first_s: float, timed: Sequence[float]) -> float:
    before = timed[-2] if len(timed) > 1 else first_s
    return abs(timed[-1] - before) / timed[-1]
