"""Views of block and model rows (issue 27): the layer-vs-block-vs-model speed-ups (the Amdahl view), the report's
"In the model" figures (tokens/s bars, attention's share against T) and the cache-on/cache-off factor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

KEY = ["impl", "baseline", "device", "dtype", "mode", "batch", "seq_len", "num_heads", "d_model", "num_kv_heads"]


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"].copy()
    ok["scope"] = ok["scope"].fillna("layer") if "scope" in ok else "layer"
    return ok


def scope_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per implementation and shape measured at more than one scope: its paired speed-up as a layer, in the
    block and in the model (NaN where that scope was not measured), against the same baseline and mode."""
    ok = _ok(df)
    ok = ok[np.isfinite(pd.to_numeric(ok["speedup"], errors="coerce")) & (ok["impl"] != ok["baseline"])]
    if ok.empty or ok["scope"].nunique() < 2:
        return pd.DataFrame()
    table = ok.pivot_table(index=KEY, columns="scope", values="speedup", aggfunc="first").reset_index()
    for scope in ("layer", "block", "model"):
        if scope not in table:
            table[scope] = np.nan
    present = table[["layer", "block", "model"]].notna().sum(axis=1) >= 2
    return table[present][[*KEY, "layer", "block", "model"]]


def scope_sentences(df: pd.DataFrame) -> list[str]:
    """``"sdpa_cache vs kv_concat, inference T=256: 2.1x as a layer, 1.3x in the block, 1.1x in the model"``."""
    out = []
    for r in scope_speedups(df).itertuples():
        parts = [f"{getattr(r, s):.2f}x {w}" for s, w in (("layer", "as a layer"), ("block", "in the block"),
                                                        ("model", "in the model")) if getattr(r, s) == getattr(r, s)]
        out.append(f"{r.impl} vs {r.baseline}, {r.mode} b={r.batch} T={r.seq_len} d={r.d_model}: " + ", ".join(parts))
    return out


def cache_factors(df: pd.DataFrame) -> pd.DataFrame:
    """End-to-end tokens/s with the KV cache over without it, per implementation and model shape."""
    ok = _ok(df)
    gen = ok[ok["mode"].isin(["generate-cache", "generate-nocache"])]
    if gen.empty:
        return pd.DataFrame()
    key = ["impl", "device", "dtype", "batch", "seq_len", "d_model", "layers", "vocab", "new_tokens"]
    t = gen.pivot_table(index=key, columns="mode", values="end_to_end_tokens_per_s", aggfunc="first").reset_index()
    if "generate-cache" not in t or "generate-nocache" not in t:
        return pd.DataFrame()
    t["factor"] = t["generate-cache"] / t["generate-nocache"]
    return t.dropna(subset=["factor"])


def model_figures(df: pd.DataFrame, styles: dict, out_dir: Path) -> list:
    """The report's "In the model" figures: end-to-end tokens/s per implementation (cache on and off) and
    attention's share of the step against T, per scope and mode (empty when the run has no block or model rows)."""
    from matplotlib.figure import Figure as MplFigure

    from attnbench.report import figures as figs

    ok = _ok(df)
    ok = ok[ok["scope"] != "layer"]
    out = []
    gen = ok[ok["mode"].astype(str).str.startswith("generate")]
    if not gen.empty:
        fig = MplFigure(figsize=(7, 0.45 * len(gen) + 1.2), layout="constrained")
        ax = fig.add_subplot()
        gen = gen.sort_values("end_to_end_tokens_per_s")
        labels = [f"{r.impl} ({'cache' if r.mode == 'generate-cache' else 'no cache'}, T={r.seq_len}+{r.new_tokens})"
                  for r in gen.itertuples()]
        ax.barh(labels, gen["end_to_end_tokens_per_s"], color=[styles.get(i, {}).get("color", "C0") for i in gen["impl"]])
        ax.set_xlabel("end-to-end tokens/s (new tokens / generation seconds)")
        png, svg, uri = figs._save(fig, out_dir, "model-tokens-per-s")
        out.append(figs.Figure("model-tokens-per-s", "Generation tokens/s", "Greedy generation, KV cache on and off.",
                               png, svg, uri))
    share = ok[np.isfinite(pd.to_numeric(ok.get("attn_share"), errors="coerce"))]
    if not share.empty:
        fig = MplFigure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        for (impl, scope, mode), g in share.groupby(["impl", "scope", "mode"]):
            g = g.sort_values("seq_len")
            ax.errorbar(g["seq_len"], 100 * g["attn_share"],
                        yerr=[100 * (g["attn_share"] - g["attn_share_low"]), 100 * (g["attn_share_high"] - g["attn_share"])],
                        marker=styles.get(impl, {}).get("marker", "o"), color=styles.get(impl, {}).get("color"),
                        capsize=3, label=f"{impl} {scope} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens; the prompt for generation)")
        ax.set_ylabel("attention's share of the step (%)")
        ax.legend(fontsize=7)
        png, svg, uri = figs._save(fig, out_dir, "model-attention-share")
        out.append(figs.Figure("model-attention-share", "Attention's share of the step",
                               "Median over steps, bars 10th..90th percentile (forward hooks around the attention "
                               "modules; backward hooks for training steps).", png, svg, uri))
    return out
