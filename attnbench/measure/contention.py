"""How much of the machine other processes and the hypervisor took while a cell was timed.

Two snapshots of ``/proc/stat`` (the kernel's count of every CPU's time, in clock ticks, by what it was
spent on) bracket the timed region, with this process's own CPU time (:func:`time.process_time`: all its
threads, plus children it reaped, from :func:`os.times`) read at the same moments. Over the region:

* ``total``: every CPU's ticks (user, nice, system, idle, iowait, irq, softirq, steal; guest time is
  already inside user and nice, so it is not added again);
* ``steal_frac = steal / total``: time the hypervisor gave this VM's CPUs to someone else;
* ``other_cpu_frac = (user + nice + system + irq + softirq - own) / total``: busy time that was not this
  process's (other processes, and interrupts), clamped to [0, 1].

**The threshold.** A cell is ``contended`` when ``other_cpu_frac + steal_frac`` exceeds
:data:`CONTENDED_FRAC` (10%) by more than the measure's resolution. The arithmetic behind 10%: the
controlled environment measures with every core but one (``n - 1`` threads on ``n`` cores). A CPU hog on
every core adds ``n`` runnable threads; the scheduler shares the cores per runnable thread, so the hogs
get ``n / (2n - 1)`` of the CPU time, over 50% on any machine. One busy single-threaded process takes up to
``1/n`` (50% on 2 cores, 12.5% on 8). An otherwise idle machine's daemons and the harness's own driver
process take a few per cent at most. 10% is far from both ends: every hog-on-all-cores cell is flagged,
a quiet machine's are not, and one busy process is flagged on machines of up to 8-10 cores, where it takes
a core the measurement needs.

**The resolution.** ``/proc/stat`` counts in ticks (``USER_HZ``, 100 per second): each CPU's idle and
iowait counters can be off by up to a tick at each end of the region, so the fractions are uncertain by
up to ``2 * cpus / total`` (2% for a 1 s region, 20% for 0.1 s). A cell is flagged only when the fractions
exceed the threshold by more than that, so a short region on a quiet machine is not flagged by rounding.

Where ``/proc/stat`` does not exist (macOS, Windows) the fractions are NaN, ``contended`` is ``unknown``,
and the row's notes say why.

**How much slowdown the load can explain** (issue 45, :func:`explainable_slowdown`). Let ``u(t)`` be the share of
all the machine's CPU time that others (other processes, interrupts, steal) take at time ``t``, and let the cell run
``k`` CPU-bound threads on ``n >= k`` CPUs under a work-conserving scheduler that is fair among the cell's own
threads. At any moment either a CPU is idle, and then no thread of the cell waits (each runs: full speed), or none
is, and then the cell's threads share ``(1 - u(t)) * n`` CPUs between ``k``: speed ``(1 - u) n / k >= 1 - u``. So the
cell's speed is never below ``1 - u(t)``, whatever the number of other threads, their weights or cgroups, and over a
timed region in which others took ``u`` on average (the recorded ``other_cpu_frac + steal_frac``) the region's
mean slowdown is at most ``1 / (1 - u)``. ``compare`` compares medians, not means: each call's slowdown is at least
1, so by Markov's inequality at most half of the calls are slowed by more than ``2 / (1 - u) - 1``; the median call's
slowdown is at most ``(1 + u) / (1 - u)``. ``u`` is taken at its upper end: the worst round's fractions (what
:func:`merge` keeps) plus the measure's resolution, ``2 / (ticks_per_s * region_s)`` (``region_s``: a lower bound
of a round's timed region). Examples: the other core of two busy (``u = 0.5``): 3x; ``u = 0.8``: 9x; ``u >= 1``:
unbounded. The bound does not need ``n`` or the threads; it assumes the load does not keep time with the cell's
calls and that the cell's quiet run was CPU-bound (a cell waiting on memory or a GPU is slowed less by CPU load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator

PROC_STAT = "/proc/stat"
CONTENDED_FRAC = 0.10
"""Other processes' plus steal's share of the machine's CPU time above which a cell is flagged (see the module)."""
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100
"""``USER_HZ``: the unit of ``/proc/stat``."""


@dataclasses.dataclass(frozen=True)
class CpuStat:
    """The ``cpu`` line of ``/proc/stat`` (ticks summed over every CPU since boot) and the number of CPUs."""

    busy: int  # user + nice + system + irq + softirq
    idle: int  # idle + iowait
    steal: int
    cpus: int

    @property
    def total(self) -> int:
        """Every tick of every CPU."""
        return self.busy + self.idle + self.steal


def parse_proc_stat(text: str) -> CpuStat:
    """The :class:`CpuStat` of ``/proc/stat``'s text (a ``ValueError`` when it has no ``cpu`` line)."""
    agg, cpus = None, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name == "cpu":
            agg = [int(v) for v in rest.split()]
        elif name.startswith("cpu") and name[3:].isdigit():
            cpus += 1
    if agg is None or len(agg) < 4:
        raise ValueError("no 'cpu' line in /proc/stat")
    agg = agg + [0] * (8 - len(agg))  # kernels before 2.6.11 have no steal column
    user, nice, system, idle, iowait, irq, softirq, steal = agg[:8]
    return CpuStat(busy=user + nice + system + irq + softirq, idle=idle + iowait, steal=steal, cpus=max(cpus, 1))


def read_proc_stat(path: str = PROC_STAT) -> CpuStat | None:
    """This machine's :class:`CpuStat` now, or None where ``path`` does not exist or does not parse."""
    try:
        with open(path) as f:
            return parse_proc_stat(f.read())
    except (OSError, ValueError):
        return None


def own_cpu_s() -> float:
    """CPU seconds this process has used (every thread), plus those of children it has waited for."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


@dataclasses.dataclass(frozen=True)
class Contention:
    """What others took of the machine over one timed region."""

    other_cpu_frac: float
    steal_frac: float
    contended: str  # "yes", "no" or "unknown"
    resolution: float = math.nan
    note: str = ""

    def row_fields(self) -> dict:
        """The row's columns."""
        return {"other_cpu_frac": self.other_cpu_frac, "steal_frac": self.steal_frac, "contended": self.contended}


UNAVAILABLE = Contention(math.nan, math.nan, "unknown",
                         note=f"contention not measured: no readable {PROC_STAT} on this system")


def compute(before: CpuStat | None, after: CpuStat | None, own_s: float, ticks_per_s: float = TICKS_PER_S,
            threshold: float = CONTENDED_FRAC) -> Contention:
    """The contention between two snapshots, this process having used ``own_s`` CPU seconds in between."""
    if before is None or after is None:
        return UNAVAILABLE
    total = after.total - before.total
    if total <= 0:
        return Contention(math.nan, math.nan, "unknown", note="contention not measured: the timed region was shorter "
                                                              f"than one tick of {PROC_STAT}")
    busy = after.busy - before.busy
    steal = after.steal - before.steal
    other = min(max((busy - own_s * ticks_per_s) / total, 0.0), 1.0)
    steal_frac = min(max(steal / total, 0.0), 1.0)
    resolution = 2 * after.cpus / total
    contended = "yes" if other + steal_frac > threshold + resolution else "no"
    note = ""
    if contended == "yes":
        note = (f"contended: other processes took {100 * other:.0f}% of the CPU time and steal {100 * steal_frac:.0f}% "
                f"while it was timed (flagged above {100 * threshold:.0f}%): its timing is inflated")
    return Contention(other, steal_frac, contended, resolution, note)


@dataclasses.dataclass
class Sample:
    """Filled in when the ``with sampled()`` block ends."""

    result: Contention = UNAVAILABLE


@contextlib.contextmanager
def sampled(path: str = PROC_STAT) -> Iterator[Sample]:
    """Bracket a timed region: ``with sampled() as s: time_fn(...)``; then ``s.result`` is its :class:`Contention`."""
    sample = Sample()
    before, own0 = read_proc_stat(path), own_cpu_s()
    try:
        yield sample
    finally:
        after, own1 = read_proc_stat(path), own_cpu_s()
        sample.result = compute(before, after, own1 - own0)


def explainable_slowdown(other_cpu_frac: float, steal_frac: float, region_s: float = math.nan,
                         ticks_per_s: float = TICKS_PER_S) -> float:
    """The largest slowdown of a cell's median call that a load of ``other_cpu_frac + steal_frac`` (the machine's
    share others and steal took over the timed region) can explain: ``(1 + u) / (1 - u)`` with ``u`` the fractions
    plus the resolution of a region of ``region_s`` seconds (none when it is unknown); ``inf`` when ``u`` reaches 1
    or a fraction is not measured. See the module docstring for the derivation."""
    fractions = [other_cpu_frac, steal_frac]
    if not all(isinstance(f, int | float) and math.isfinite(f) for f in fractions):
        return math.inf
    u = max(0.0, other_cpu_frac) + max(0.0, steal_frac)
    if isinstance(region_s, int | float) and math.isfinite(region_s) and region_s > 0:
        u += 2 / (ticks_per_s * region_s)
    return math.inf if u >= 1 else (1 + u) / (1 - u)


def merge(rows: list[dict]) -> dict:
    """The contention columns of a cell measured in several rounds: the worst round's fractions; ``yes`` when any
    round was contended (its samples are among the cell's), ``unknown`` when no round could be measured."""
    flags = [str(r.get("contended") or "unknown") for r in rows]
    measured = [r for r, f in zip(rows, flags, strict=True) if f != "unknown"]
    if not measured:
        return {"other_cpu_frac": math.nan, "steal_frac": math.nan, "contended": "unknown"}
    return {"other_cpu_frac": max(float(r["other_cpu_frac"]) for r in measured),
            "steal_frac": max(float(r["steal_frac"]) for r in measured),
            "contended": "yes" if "yes" in flags else "no"}


def merge_note(rows: list[dict]) -> str:
    """``contended in k of n rounds`` for a cell some of whose rounds were contended, else ""."""
    k = sum(str(r.get("contended")) == "yes" for r in rows)
    return f"contended in {k} of {len(rows)} rounds" if k else ""


def contended_mask(df):
    """A boolean Series: the ok rows of results ``df`` flagged contended (False where unknown or not measured)."""
    import pandas as pd

    if "contended" not in df:
        return pd.Series(False, index=df.index)
    return (df["status"] == "ok") & (df["contended"].astype(str) == "yes")


def summary(df) -> str | None:
    """One line on how much of a run was contended, or None when no cell was."""
    ok = df[df["status"] == "ok"]
    flagged = int(contended_mask(df).sum())
    if not flagged:
        return None
    return (f"{flagged} of {len(ok)} timed cell(s) ({100 * flagged / max(len(ok), 1):.0f}%) were contended: other "
            f"processes or the hypervisor took over {100 * CONTENDED_FRAC:.0f}% of the CPU time while they were timed, "
            "so their timings are inflated; rerun them on a quiet machine (`attnbench run` waits for other "
            "attnbench measurements, not for other programs)")
