"""The report's "In the model" figures (issue 27): end-to-end tokens/s per implementation and attention's share of
the step against T, drawn from the block and model rows (:mod:`attnbench.models.views` holds the tables)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure

from attnbench.models.views import ok_scoped
from attnbench.report import figures as figs


def model_figures(df: pd.DataFrame, styles: dict, out_dir: Path) -> list:
    """The report's "In the model" figures: end-to-end tokens/s per implementation (cache on and off) and
    attention's share of the step against T, per scope and mode (empty when the run has no block or model rows)."""
    ok = ok_scoped(df)
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
