"""Views of block and model rows (issue 27): the layer-vs-block-vs-model speed-ups (the Amdahl view) and the
cache-on/cache-off factor (the report's "In the model" figures: :mod:`attnbench.report.model_figures`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

KEY = ["impl", "baseline", "device", "dtype", "mode", "batch", "seq_len", "num_heads", "d_model", "num_kv_heads"]


def ok_scoped(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows, with scope filled (layer where a row has none)."""
    ok = df[df["status"] == "ok"].copy()
    ok["scope"] = ok["scope"].fillna("layer") if "scope" in ok else "layer"
    return ok


def scope_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per implementation and shape measured at more than one scope: its paired speed-up as a layer, in the
    block and in the model (NaN where that scope was not measured), against the same baseline and mode."""
    ok = ok_scoped(df)
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
    ok = ok_scoped(df)
    gen = ok[ok["mode"].isin(["generate-cache", "generate-nocache"])]
    if gen.empty:
        return pd.DataFrame()
    key = ["impl", "device", "dtype", "batch", "seq_len", "d_model", "layers", "vocab", "new_tokens"]
    t = gen.pivot_table(index=key, columns="mode", values="end_to_end_tokens_per_s", aggfunc="first").reset_index()
    if "generate-cache" not in t or "generate-nocache" not in t:
        return pd.DataFrame()
    t["factor"] = t["generate-cache"] / t["generate-nocache"]
    return t.dropna(subset=["factor"])
