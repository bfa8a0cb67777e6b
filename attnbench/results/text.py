"""How a row's values read as text: times, bytes, numbers and configuration labels.

The one definition the console tables, the report, ``compare`` and the profiler's tables share (no
pandas, no plotting): a new axis of the row gets its label here once.
"""

from __future__ import annotations

import math

TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))
"""Seconds per unit, largest first."""
MISSING = "–"

_AXIS_LABEL = {"batch": "B={}", "num_heads": "h={}", "d_model": "d={}", "cache": "cache={}", "seq_len": "T={}",
               "num_kv_heads": "kv={}"}


def _finite(x) -> bool:
    try:
        return x is not None and math.isfinite(x)
    except TypeError:
        return False


def time_unit(seconds: float) -> tuple[float, str]:
    """``(scale, unit)`` that shows ``seconds`` with 1 to 999 units, e.g. ``(1e-3, "ms")`` for 0.0042."""
    a = abs(seconds) if _finite(seconds) else 0.0
    return next(((s, u) for s, u in TIME_UNITS if a >= s), TIME_UNITS[-1])


def fmt_time(seconds: float) -> str:
    """``1.23 ms``, ``45.6 µs``, ``2.1 s``; ``–`` for NaN or None."""
    if not _finite(seconds):
        return MISSING
    scale, unit = time_unit(seconds)
    return f"{seconds / scale:.3g} {unit}"


def fmt_ci(lo: float, hi: float) -> str:
    """``14.9–21.9 µs`` (one unit when both ends share it), ``–`` when missing."""
    a, b = fmt_time(lo), fmt_time(hi)
    if MISSING in (a, b):
        return MISSING
    ua, ub = a.split(" ", 1)[1], b.split(" ", 1)[1]
    return f"{a.split(' ', 1)[0]}–{b}" if ua == ub else f"{a} – {b}"


def fmt_bytes(n: float) -> str:
    """``12.3 MiB`` (negative too: a net free); ``–`` for NaN or None."""
    if not _finite(n):
        return MISSING
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_num(x: float, digits: int = 3) -> str:
    """A float with ``digits`` significant digits; ``–`` for NaN or None."""
    if not _finite(x):
        return MISSING
    return f"{x:.{digits}g}"


def fmt_contention(row) -> str:
    """``contended (others 47%, steal 0%)`` for a row flagged ``contended``; "" otherwise (not contended, or not
    measured). ``row`` is a dict, a pandas row or a named tuple."""
    get = _getter(row)
    if str(get("contended")) != "yes":
        return ""
    other, steal = get("other_cpu_frac"), get("steal_frac")
    parts = [f"others {100 * other:.0f}%" if _finite(other) else "", f"steal {100 * steal:.0f}%" if _finite(steal) else ""]
    return "contended (" + ", ".join(p for p in parts if p) + ")"


def fmt_speedup(speedup: float, lo: float = float("nan"), hi: float = float("nan"), unstable: bool = False) -> str:
    """``1.23× (1.18–1.29)`` (a speed-up and its CI); ``1.23×`` without a CI; ``, unstable`` appended for a
    member flagged unstable (its speed-up may move between runs); ``–`` for NaN or None."""
    if not _finite(speedup):
        return MISSING
    text = f"{speedup:.3g}×"
    if _finite(lo) and _finite(hi):
        text += f" ({lo:.3g}–{hi:.3g})"
    return text + (", unstable" if unstable else "")


def axis_label(axis: str, value) -> str:
    """How one axis value reads (``B=1``, ``h=8``, ``T=128``, ``float32``, ``window 64``, ``non-causal`` ...)."""
    if axis == "window":  # NaN, None, 0 or -1 (compare's key for it): full attention
        return "full attention" if not _finite(value) or value <= 0 else f"window {int(value)}"
    if axis == "causal":
        return "causal" if bool(value) else "non-causal"
    if axis == "positional":  # issue 26: RoPE / QK-norm / scale / softcap, "" = none
        return str(value).replace(";", ", ") if value else "no RoPE"
    if axis == "lengths":  # issue 37: a length distribution, "" = a rectangular batch
        return f"lengths {value}" if value and value == value else "rectangular"
    if axis == "batch_spec":  # issue 48: a mixed serving step, "" = not one
        return f"step {value}" if value and value == value else "no mixed step"
    return _AXIS_LABEL.get(axis, "{}").format(value)


def _getter(row):
    return row.get if hasattr(row, "get") else (lambda key: getattr(row, key, None))


def variant_labels(row) -> list[str]:
    """The attention-variant axes that differ from causal multi-head attention (``kv=2``, ``window 64``,
    ``non-causal``), for labels; empty for the book's attention or a row without those axes."""
    get = _getter(row)
    kv, heads, window, causal = get("num_kv_heads"), get("num_heads"), get("window"), get("causal")
    out = []
    if _finite(kv) and kv and kv != heads:
        out.append(axis_label("num_kv_heads", int(kv)))
    if _finite(window) and window:
        out.append(axis_label("window", window))
    if causal is not None and not bool(causal):
        out.append(axis_label("causal", False))
    if get("inputs") not in (None, "", "normal"):  # issue 38: stress inputs
        out.append(f"{get('inputs')} inputs")
    lengths = get("lengths")
    if isinstance(lengths, str) and lengths:  # issue 37: a variable-length batch
        out.append(axis_label("lengths", lengths))
    spec = get("batch_spec")
    if isinstance(spec, str) and spec:  # issue 48: a mixed serving step
        out.append(axis_label("batch_spec", spec))
    return out


def configuration_label(row) -> str:
    """``cpu/float32/forward (B=1, h=4, d=64)`` (``, cache=cold`` when cold): every axis but impl and T.

    ``row`` is a dict, a pandas row or a named tuple with the axis names.
    """
    get = _getter(row)
    sizes = [axis_label(a, get(a)) for a in ("batch", "num_heads", "d_model")]
    if get("cache") and get("cache") != "warm":
        sizes.append(axis_label("cache", get("cache")))
    sizes += variant_labels(row)
    return f"{get('device')}/{get('dtype')}/{get('mode')} ({', '.join(sizes)})"


def cell_label(row) -> str:
    """``sdpa @ cpu/float32/forward (B=1, h=4, d=64) T=128``: one cell, every axis."""
    get = _getter(row)
    return f"{get('impl')} @ {configuration_label(row)} {axis_label('seq_len', get('seq_len'))}"


def fmt_lead(ratio, other: str) -> str:
    """How far the fastest is ahead of ``other`` (``ratio``: its speed over the other's, a number or its text):
    ``1.43× as fast as sdpa``; less than 1% ahead: ``level with sdpa (within 1%)``, never ``1× ahead``."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        value = math.nan
    if not _finite(value):
        return f"ahead of {other}"
    if value < 1.01:
        return f"level with {other} (within 1%)"
    return f"{value:.2f}× as fast as {other}"


def short_names(names) -> dict[str, str]:
    """Console names for implementations given as ``PATH:Class`` (a plug-in file): the fewest trailing path parts that
    still tell the names apart (``buggy.py:NoScale``), so that an absolute path does not take the whole table; other
    names are kept. The full names stay in the results and in every warning."""
    names = sorted({str(n) for n in names})
    out = {n: n for n in names}
    filed = [n for n in names if ":" in n and "/" in n.rsplit(":", 1)[0]]
    for n in filed:
        path, attr = n.rsplit(":", 1)
        parts = path.split("/")
        for k in range(1, len(parts) + 1):
            candidate = "/".join(parts[-k:]) + ":" + attr
            if not any(m != n and m.rsplit(":", 1)[0].endswith("/".join(parts[-k:])) and m.endswith(":" + attr)
                       for m in filed) and candidate not in names:
                out[n] = candidate
                break
    return out
