"""Report pieces for attention variants and KV-cache decoding: two figures and the sentences under them.

* decode latency against cache length (one line per implementation and variant), and the decode step's
  memory bandwidth (GB/s of the bytes it must read, with the run's measured STREAM-like peak);
* KV-cache bytes against context length, measured (markers) and analytic (dashed), per variant
  (MHA, GQA(k), MQA, SWA(w));
* sentences computed from the rows, e.g. "at T=4096, GQA(4) keeps 25% of MHA's cache and decodes 1.3×
  faster than MHA (kv_prealloc, cpu/float32, B=2, h=16, d=1024)", and, for sliding windows, how decode
  latency changes once the cache is longer than the window, and what bandwidth a decode step reaches:
  "kv_prealloc MHA at T=4096 reads 8.4 MB per step at 6.1 GB/s, 45% of the measured 13.6 GB/s peak (…)".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter

from attnbench.report import analysis as an
from attnbench.report import figures as figs

CONFIG = ("device", "dtype", "batch", "num_heads", "d_model")
"""A decode configuration: within it, lines are implementation x variant over seq_len."""


def variant_label(num_heads: int, num_kv_heads: int, window: int, causal: bool = True) -> str:
    """``MHA``, ``GQA(4)``, ``MQA``, ``SWA(64)``, ``GQA(2)+SWA(64)``, with ``non-causal`` when it is not causal."""
    kv = "MHA" if num_kv_heads in (0, num_heads) else "MQA" if num_kv_heads == 1 else f"GQA({num_kv_heads})"
    parts = [kv] if kv != "MHA" or not window else []
    if window:
        parts.append(f"SWA({window})")
    return "+".join(parts) + ("" if causal else " non-causal")


def _decode(df: pd.DataFrame) -> pd.DataFrame:
    ok = an.ok_rows(df)
    ok = ok[ok["mode"] == "decode"].copy()
    if len(ok):
        ok["variant"] = [variant_label(h, kv, w, c) for h, kv, w, c in
                         zip(ok["num_heads"], ok["num_kv_heads"], ok["window"], ok["causal"], strict=True)]
        ok = _one_line_per_page_size(ok)
    return ok


def _one_line_per_page_size(ok: pd.DataFrame) -> pd.DataFrame:
    """Issue 37: a paged cache's variant names its page size (``GQA(2) p16``: a line per page size); a contiguous
    cache timed in several page-size groups (the same shape) keeps its first row, so that its line is one line."""
    if "pages" not in ok.columns or "page_size" not in ok.columns:
        return ok
    paged = np.isfinite(pd.to_numeric(ok["pages"], errors="coerce").astype(float))
    ok.loc[paged, "variant"] = [f"{v} p{int(p)}" for v, p in zip(ok.loc[paged, "variant"], ok.loc[paged, "page_size"],
                                                                     strict=True)]
    same = [c for c in (*CONFIG, "impl", "variant", "positional", "seq_len") if c in ok.columns]
    return ok[paged | ~ok.duplicated(same)]


def _config_label(values: dict) -> str:
    return f"{values['device']}/{values['dtype']}, B={values['batch']}, h={values['num_heads']}, d={values['d_model']}"


def sentences(df: pd.DataFrame) -> list[str]:
    """What the decode rows say, in words (an empty list when the run has no decode rows)."""
    ok = _decode(df)
    out: list[str] = []
    for key, rows in ok.groupby(list(CONFIG), sort=True):
        config = _config_label(dict(zip(CONFIG, key, strict=True)))
        for impl, r in rows.groupby("impl", sort=False):
            mha = r[r["variant"] == "MHA"].set_index("seq_len")
            for variant, v in r[r["variant"] != "MHA"].groupby("variant", sort=False):
                shared = sorted(set(v["seq_len"]) & set(mha.index))
                if not shared:
                    continue
                T = shared[-1]
                row = v[v["seq_len"] == T].iloc[0]
                base = mha.loc[T]
                cache = row["kv_cache_bytes"] / base["kv_cache_bytes"] if base["kv_cache_bytes"] > 0 else np.nan
                speed = base["median_s"] / row["median_s"]
                faster = f"{an.fmt_num(speed)}× faster" if speed >= 1 else f"{an.fmt_num(1 / speed)}× slower"
                kept = f"keeps {100 * cache:.0f}% of MHA's cache and " if np.isfinite(cache) else ""
                out.append(f"At T={T}, {variant} {kept}decodes {faster} than MHA ({impl}, {config}).")
        for (impl, variant), r in rows[rows["window"] > 0].groupby(["impl", "variant"], sort=False):
            w = int(r["window"].iloc[0])
            beyond = r[r["seq_len"] >= w].sort_values("seq_len")
            if len(beyond) >= 2:
                lo, hi = beyond.iloc[0], beyond.iloc[-1]
                out.append(f"{impl} {variant}: decode latency at T={hi['seq_len']} is {an.fmt_num(hi['median_s'] / lo['median_s'])}× "
                           f"that at T={lo['seq_len']} (both beyond the window of {w}; its cache holds "
                           f"{an.fmt_bytes(hi['kv_cache_bytes'])} at both), {config}.")
        out += _bandwidth_sentences(rows, config)
    return out


ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def cache_per_token(df: pd.DataFrame) -> pd.DataFrame:
    """KV-cache bytes per cached token and sequence (issue 26), per configuration, implementation and variant, at
    the longest cache: the measured ``kv_cache_bytes / (batch * seq_len)`` against MHA's ``2 * d_model`` elements
    per token (keys and values of every head), so GQA, MQA, windows and a latent cache (MLA) compare at one shape."""
    ok = _decode(df)
    ok = ok[np.isfinite(ok["kv_cache_bytes"].astype(float)) & (ok["kv_cache_bytes"].astype(float) > 0)]
    columns = ["configuration", "impl", "variant", "positional", "T", "bytes_per_token", "of_mha"]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for key, r in ok.groupby([*CONFIG, "impl", "variant", "positional"], sort=False, dropna=False):
        row = r.sort_values("seq_len").iloc[-1]
        per_token = float(row["kv_cache_bytes"]) / (int(row["batch"]) * int(row["seq_len"]))
        mha = 2 * int(row["d_model"]) * ELEMENT_BYTES.get(str(row["dtype"]), np.nan)
        rows.append({"configuration": _config_label(dict(zip(CONFIG, key, strict=False))), "impl": row["impl"],
                     "variant": row["variant"], "positional": row.get("positional") or "", "T": int(row["seq_len"]),
                     "bytes_per_token": per_token, "of_mha": per_token / mha})
    return pd.DataFrame(rows, columns=columns)


def cache_per_token_display(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`cache_per_token` formatted for the report."""
    out = table.copy()
    out["bytes_per_token"] = [an.fmt_bytes(v) if v >= 1024 else f"{v:.0f} B" for v in table["bytes_per_token"]]
    out["of_mha"] = [f"{100 * v:.0f}%" if np.isfinite(v) else "–" for v in table["of_mha"]]
    return out.rename(columns={"bytes_per_token": "cache per token", "of_mha": "of MHA's 2·d_model"})


def _has_bandwidth(ok: pd.DataFrame) -> pd.DataFrame:
    """The decode rows with a bandwidth figure (runs older than the columns have none)."""
    if "gbytes_per_s" not in ok.columns:
        return ok.iloc[0:0]
    return ok[np.isfinite(ok["gbytes_per_s"].astype(float)) & (ok["gbytes_per_s"].astype(float) > 0)]


def _bandwidth_sentences(rows: pd.DataFrame, config: str) -> list[str]:
    """One sentence per implementation and variant: its bandwidth at the longest cache, against the peak."""
    out = []
    for (impl, variant), r in _has_bandwidth(rows).groupby(["impl", "variant"], sort=False):
        row = r.sort_values("seq_len").iloc[-1]
        peak = float(row["peak_gbytes_per_s"])
        of_peak = f", {100 * row['frac_peak_bw']:.0f}% of the measured {an.fmt_num(peak)} GB/s peak" if np.isfinite(peak) else ""
        out.append(f"{impl} {variant} at T={row['seq_len']} reads {an.fmt_bytes(row['decode_bytes'])} per step "
                   f"(KV cache + weights) at {an.fmt_num(row['gbytes_per_s'])} GB/s{of_peak} ({config}).")
    return out


def _panels(ok: pd.DataFrame) -> list[an.Group]:
    panels = []
    for key, rows in ok.groupby(list(CONFIG), sort=True):
        values = dict(zip(CONFIG, key, strict=True))
        label = _config_label(values)
        panels.append(an.Group(tuple(key), values, label, label, rows))
    return panels


def _line_styles(ok: pd.DataFrame, styles: dict) -> dict[tuple[str, str], dict]:
    """One color per implementation (the report's), one line style per variant."""
    dashes = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 1)), (0, (3, 1, 1, 1))]
    variants = list(dict.fromkeys(ok.sort_values(["num_kv_heads", "window"], ascending=[False, True])["variant"]))
    return {(i, v): {**styles[i], "linestyle": dashes[variants.index(v) % len(dashes)]}
            for i, v in zip(ok["impl"], ok["variant"], strict=True)}


@figs._styled
def decode_latency(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[figs.Figure]:
    """Decode-step latency against the number of cached tokens, per implementation and variant."""
    ok = _decode(df)
    if ok.empty:
        return [figs.Figure("decode-latency", "Decode latency vs cache length", skipped="no successful decode cells")]
    line = _line_styles(ok, styles)

    def draw(ax, g, seen):
        for (impl, variant), r in g.rows.groupby(["impl", "variant"], sort=False):
            r = r.sort_values("seq_len")
            st = line[(impl, variant)]
            ax.plot(r["seq_len"], r["median_s"], color=st["color"], marker=st["marker"], linestyle=st["linestyle"],
                    label=f"{impl} {variant}")
            seen.impls.add(f"{impl} {variant}")
        figs._seq_axis(ax, g.rows["seq_len"])
        ax.set_xlabel("tokens in the KV cache (T)")
        figs._log_y(ax, g.rows["median_s"], an.fmt_time)
        ax.set_ylabel("decode step (median)")

    def handles(seen):
        out = []
        for (impl, variant), st in line.items():
            if f"{impl} {variant}" in seen.impls:
                out.append(figs.Line2D([], [], color=st["color"], marker=st["marker"], linestyle=st["linestyle"],
                                       label=figs.label(f"{impl} {variant}", 48)))
        return out

    latency = figs._paneled("decode-latency", "Decode latency vs cache length", df[df["mode"] == "decode"], _panels(ok),
                            draw, handles, "One new token's attention step with T tokens already cached (prefill not "
                            "timed). A sliding-window cache stops growing at the window, so its latency flattens.",
                            out_dir, max_cols=3)
    return latency + _decode_bandwidth(df, ok, line, handles, out_dir)


def _decode_bandwidth(df: pd.DataFrame, ok: pd.DataFrame, line: dict, handles, out_dir: Path) -> list[figs.Figure]:
    """Decode GB/s against cache length, with the measured bandwidth peak dotted (and a fraction-of-peak axis)."""
    ok = _has_bandwidth(ok)
    if ok.empty:
        return [figs.Figure("decode-bandwidth", "Decode bandwidth vs cache length",
                            skipped="no decode cell has a bandwidth figure (gbytes_per_s is empty)")]

    def draw(ax, g, seen):
        for (impl, variant), r in g.rows.groupby(["impl", "variant"], sort=False):
            r = r.sort_values("seq_len")
            st = line[(impl, variant)]
            ax.plot(r["seq_len"], r["gbytes_per_s"], color=st["color"], marker=st["marker"], linestyle=st["linestyle"])
            seen.impls.add(f"{impl} {variant}")
        figs._seq_axis(ax, g.rows["seq_len"])
        ax.set_xlabel("tokens in the KV cache (T)")
        ax.set_ylabel("GB/s (bytes a step must read / median)")
        peaks = g.rows["peak_gbytes_per_s"].astype(float).dropna()
        peaks = peaks[peaks > 0]
        if not peaks.empty:
            peak = float(peaks.median())
            ax.axhline(peak, color="#555", linestyle=":", linewidth=1.3)
            ax.set_ylim(0, peak * 1.15)
            sec = ax.secondary_yaxis("right", functions=(lambda v: v / peak, lambda f: f * peak))
            sec.set_ylabel("fraction of measured peak")
            sec.yaxis.set_major_formatter(FuncFormatter(lambda f, _: f"{f:.0%}"))

    def with_peak(seen):
        return handles(seen) + [figs.Line2D([], [], color="#555", linestyle=":", label="measured peak GB/s (copy/triad)")]

    return figs._paneled("decode-bandwidth", "Decode bandwidth vs cache length", df[df["mode"] == "decode"], _panels(ok),
                         draw, with_peak, "A decode step is bound by memory: the bytes it must read (the KV cache it "
                         "attends over plus the projection weights, decode_bytes) over its median time. Dotted: the "
                         "run's STREAM-like copy/triad peak (right axis: the frac_peak_bw column).", out_dir, max_cols=3)


@figs._styled
def kv_cache_bytes(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[figs.Figure]:
    """KV-cache bytes against context length: measured per implementation, analytic per variant."""
    ok = _decode(df)
    ok = ok[np.isfinite(ok["kv_cache_bytes"].astype(float)) & (ok["kv_cache_bytes"].astype(float) > 0)]
    if ok.empty:
        return [figs.Figure("kv-cache", "KV-cache bytes vs context length", skipped="no decode cell measured its cache")]
    line = _line_styles(ok, styles)

    def draw(ax, g, seen):
        for variant, r in g.rows.groupby("variant", sort=False):
            a = r.drop_duplicates("seq_len").sort_values("seq_len")
            ax.plot(a["seq_len"], a["kv_cache_bytes_analytic"], color="#444", linestyle="--", linewidth=1.0)
            last = a.iloc[-1]
            ax.annotate(variant, (last["seq_len"], last["kv_cache_bytes_analytic"]), fontsize=8, color="#444",
                        xytext=(3, 0), textcoords="offset points", va="center")
        for (impl, variant), r in g.rows.groupby(["impl", "variant"], sort=False):
            r = r.sort_values("seq_len")
            st = line[(impl, variant)]
            ax.plot(r["seq_len"], r["kv_cache_bytes"], color=st["color"], marker=st["marker"], linestyle="none",
                    markerfacecolor="none", markeredgewidth=1.3)
            seen.impls.add(impl)
        figs._seq_axis(ax, g.rows["seq_len"])
        ax.set_xlabel("context length T (tokens cached)")
        figs._log_y(ax, pd.concat([g.rows["kv_cache_bytes"], g.rows["kv_cache_bytes_analytic"]]), an.fmt_bytes, base=2)
        ax.set_ylabel("KV-cache bytes")

    def handles(seen):
        return ([figs._impl_handle(i, styles[i], linestyle="none", markerfacecolor="none") for i in sorted(seen.impls)]
                + [figs.Line2D([], [], color="#444", linestyle="--", label="analytic 2·b·min(T,w)·kv·hd·bytes")])

    return figs._paneled("kv-cache", "KV-cache bytes vs context length", df[df["mode"] == "decode"], _panels(ok),
                         draw, handles, "Markers: bytes of the cache tensors after the prefill (measured); dashed: "
                         "the analytic size, labelled by variant (MHA, GQA(k) with k kv heads, MQA, SWA(w)).",
                         out_dir, max_cols=3)
