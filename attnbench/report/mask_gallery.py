"""The report's mask gallery (issue 37): each mask of a run drawn as a small image beside its timings.

A panel per mask (``mask_label``: ``causal+window:128+alibi``): the query-key pairs the mask keeps at the row's
sequence length (black = attended, sampled at most :data:`PIXELS` positions a side, so a 1024-token mask is drawn at
256 x 256), ALiBi drawn as ``exp(bias)`` of its gentlest head (darker = less penalised), and under it each implementation's median at
that mask, the fraction of pairs kept, and why an implementation has no time there (skipped). Drawn only when a run
has more than one mask, or a mask beyond causal / window / softcap.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from attnbench.correctness import masks
from attnbench.report import analysis as an
from attnbench.report import figures as figs
from attnbench.results.schema import Cell
from attnbench.runner.masks import mask_fields

PIXELS = 256
COLUMNS = 4


def _image(row) -> np.ndarray:
    """The kept pairs of ``row``'s mask (1 = attended; with ALiBi: ``exp(bias)`` of the head with the gentlest slope), sampled to PIXELS."""
    cell = Cell("x", seq_len=int(row.seq_len), num_heads=int(row.num_heads), mode=str(row.mode),
                window=None if row.window != row.window else int(row.window), causal=bool(row.causal),
                mask=str(row["mask"] or ""))
    fields = mask_fields(cell)
    pos = torch.linspace(0, cell.seq_len - 1, min(cell.seq_len, PIXELS)).round().long()
    keep = masks.keep(pos[:, None], pos[None, :], causal=cell.causal, window=cell.window, prefix=fields.get("prefix"),
                      documents=fields.get("documents")).double()
    if fields.get("alibi"):
        keep = keep * torch.exp(-masks.alibi_slopes(cell.num_heads)[-1] * (pos[:, None] - pos[None, :]).abs())
    return keep.numpy()


def _caption_lines(rows: pd.DataFrame) -> list[str]:
    lines = []
    for impl, r in rows.groupby("impl", sort=True):
        ok = r[r.status == "ok"]
        lines.append(f"{impl}: {an.fmt_time(float(ok.median_s.min()))}" if not ok.empty else f"{impl}: skipped")
    return lines


def gallery(df: pd.DataFrame, out_dir: Path) -> list[figs.Figure]:
    """The mask gallery's figure, or ``[]`` when the run has no masks to show."""
    if "mask_label" not in df or df["mask_label"].fillna("").eq("").all():
        return []
    rows = df[df["scope"].fillna("layer").eq("layer") & df["mode"].ne("decode") & df["mask_label"].fillna("").ne("")]
    labels = list(dict.fromkeys(rows["mask_label"]))
    if len(labels) < 2 and not rows["mask"].fillna("").ne("").any():
        return []
    ncols = min(COLUMNS, len(labels))
    nrows = math.ceil(len(labels) / ncols)
    fig = figs.MplFigure(figsize=(2.6 * ncols, 4.0 * nrows), layout="constrained")
    for i, label in enumerate(labels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        group = rows[rows["mask_label"] == label]
        first = group.iloc[0]
        group = group[(group.seq_len == first.seq_len) & (group.batch == first.batch) & (group.d_model == first.d_model)]
        ax.imshow(_image(first), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks([]), ax.set_yticks([])
        ax.grid(False)
        density = group["mask_density"].dropna()
        kept = f", {100 * float(density.iloc[0]):.0f}% kept" if not density.empty else ""
        ax.set_title(f"{label}\nT={int(first.seq_len)}{kept}", fontsize=8.5)
        ax.set_xlabel("\n".join(_caption_lines(group)), fontsize=8)
    png, svg, uri = figs._save(fig, out_dir, "mask-gallery")
    caption = ("Each mask of the run as the pairs it keeps (rows: queries, columns: keys; black: attended; with ALiBi "
               "the shade is exp(bias) of the head with the gentlest slope), with each implementation's median at "
               "that mask (the fastest shape measured at the first row's T); skipped: the implementation does not "
               "declare that mask.")
    return [figs.Figure("mask-gallery", "Mask gallery", caption=caption, png=png, svg=svg, data_uri=uri,
                        kind="heatmap")]
