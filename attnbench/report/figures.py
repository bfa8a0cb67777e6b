"""Report figures: matplotlib (object API, no pyplot state), each saved as PNG and SVG and embedded as a data URI.

A figure that cannot be drawn (no successful cells, nothing measured) is not drawn: it comes back with
``skipped`` set to the reason, which the report prints in its place.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure as MplFigure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

from attnbench.report import analysis as an

STYLE = {
    "font.size": 10, "axes.titlesize": 10.5, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
    "legend.fontsize": 9, "axes.grid": True, "grid.alpha": 0.35, "grid.linewidth": 0.6, "lines.linewidth": 1.8,
    "lines.markersize": 5, "axes.spines.top": False, "axes.spines.right": False, "svg.fonttype": "path",
    "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
    # a fixed title height: matplotlib otherwise measures every axis' tick labels at each draw to see whether a
    # title must move up (it never must here: no top ticks, no offset text); a quarter of each figure's drawing
    "axes.titley": 1.0,
}
PNG_DPI = 150
PNG_COMPRESS_LEVEL = 3
MAX_PANELS = 9
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


@dataclass
class Figure:
    """One figure of a report: its files and data URI, or why it was not drawn."""

    name: str
    title: str
    caption: str = ""
    png: Path | None = None
    svg: Path | None = None
    data_uri: str | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    kind: str = "panels"  # how it is drawn: "panels" (lines per configuration) or "heatmap"


def impl_styles(names: Sequence[str]) -> dict[str, dict]:
    """A stable colour and marker per implementation: tab20 by sorted name (dark shades first)."""
    cmap = matplotlib.colormaps["tab20"]
    slots = list(range(0, 20, 2)) + list(range(1, 20, 2))
    out = {}
    for i, name in enumerate(sorted(set(names))):
        rgba = cmap(slots[i % len(slots)])
        out[name] = {"color": matplotlib.colors.to_hex(rgba), "marker": MARKERS[i % len(MARKERS)]}
    return out


# ---------------------------------------------------------------- helpers


def _styled(fn):
    """Run a figure function with :data:`STYLE` in effect (rc parameters are read when artists are made)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)

    return wrapper


def _new_figure(n_panels: int, panel_w: float = 3.7, panel_h: float = 3.0) -> tuple[MplFigure, list]:
    if n_panels == 1:
        fig = MplFigure(figsize=(7.0, 4.4), layout="constrained")
        return fig, [fig.add_subplot(1, 1, 1)]
    ncols = 2 if n_panels in (2, 4) else 3
    nrows = math.ceil(n_panels / ncols)
    w = 10.5 if ncols == 3 else 9.0
    fig = MplFigure(figsize=(w, nrows * panel_h + 0.9), layout="constrained")
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n_panels)]
    return fig, axes


@dataclass(frozen=True)
class Render:
    """How figures are written: PNG resolution, and whether an SVG is written next to each PNG (the PNG is
    always written: the page embeds it)."""

    dpi: int = PNG_DPI
    svg: bool = True

    @property
    def formats(self) -> tuple[str, ...]:
        """The file formats written per figure."""
        return ("png", "svg") if self.svg else ("png",)


_render: contextvars.ContextVar[Render | None] = contextvars.ContextVar("attnbench_report_render", default=None)


@contextlib.contextmanager
def rendering(render: Render):
    """Write the figures made inside the block with ``render`` (``build_report``'s ``dpi`` and ``formats``)."""
    token = _render.set(render)
    try:
        yield render
    finally:
        _render.reset(token)


def current_render() -> Render:
    """The :class:`Render` in effect (the defaults outside :func:`rendering`)."""
    return _render.get() or Render()


def _save(fig: MplFigure, out_dir: Path, name: str) -> tuple[Path, Path | None, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    render = current_render()
    png, svg = out_dir / f"{name}.png", out_dir / f"{name}.svg"
    engine = fig.get_layout_engine()
    if engine is not None:  # lay it out once, at the PNG's resolution, as savefig would: savefig itself first draws
        fig.dpi = render.dpi  # the whole figure without output before each save when a layout engine is set
        engine.execute(fig)
        fig.set_layout_engine(None)  # none at all ("none" leaves a placeholder, and savefig draws for it)
    # zlib level 3 instead of PIL's 6: the same pixels, files ~4% larger, encoding about twice as fast
    fig.savefig(png, dpi=render.dpi, metadata={"Software": None}, pil_kwargs={"compress_level": PNG_COMPRESS_LEVEL})
    if render.svg:
        fig.savefig(svg, metadata={"Date": None})
    uri = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")
    return png, svg if render.svg else None, uri


def _seq_axis(ax, ts: Sequence[int]) -> None:
    ts = sorted({int(t) for t in ts if t > 0})
    ax.set_xscale("log", base=2)
    if 0 < len(ts) <= 9:
        ax.xaxis.set_major_locator(FixedLocator(ts))
    else:
        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=9))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}" if v >= 1 else f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    if len(ts) == 1:
        ax.set_xlim(ts[0] / 1.6, ts[0] * 1.6)
    ax.set_xlabel("sequence length T")


def _log_y(ax, values, fmt: Callable[[float], str], base: int = 10) -> None:
    v = np.asarray([x for x in values if np.isfinite(x) and x > 0], dtype=float)
    ax.set_yscale("log", base=base)
    span = np.log10(v.max() / v.min()) if len(v) else 0.0
    if base == 10:
        subs = (1.0, 2.0, 5.0) if span < 1.5 else (1.0, 3.0) if span < 3 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    else:
        ax.yaxis.set_major_locator(LogLocator(base=base, numticks=10))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt(y)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    if len(v) and span < 0.05:  # one value or nearly: give the axis some room so a tick shows
        ax.set_ylim(v.min() / 1.5, v.max() * 1.5)


RATIO_MANTISSAS = ((1.0,), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0),
                   (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0))
"""Tick values of a ratio axis (times a power of ten), coarse to fine; powers of two come second."""
MAX_RATIO_TICKS = 8


def ratio_ticks(lo: float, hi: float) -> list[float]:
    """Readable ticks of a log-scale ratio axis over ``[lo, hi]`` (``0.5×, 1×, 2×``; ``0.8×, 1×, 1.25×``): the
    coarsest family that puts at least three ticks in the range, at most :data:`MAX_RATIO_TICKS` (thinned around
    1); a range too narrow for any (``0.97–1.04``) gets evenly spaced round values."""
    families = [sorted(m * 10.0 ** k for m in RATIO_MANTISSAS[0] for k in range(-9, 10)),
                [2.0 ** k for k in range(-30, 31)],
                *(sorted(m * 10.0 ** k for m in ms for k in range(-9, 10)) for ms in RATIO_MANTISSAS[1:])]
    for family in families:
        ticks = [t for t in family if lo <= t <= hi]
        if len(ticks) >= 3:
            break
    else:
        from matplotlib.ticker import MaxNLocator

        ticks = [float(t) for t in MaxNLocator(nbins=4, steps=[1, 2, 5, 10]).tick_values(lo, hi) if lo <= t <= hi]
    step = math.ceil(len(ticks) / MAX_RATIO_TICKS)
    anchor = min(range(len(ticks)), key=lambda i: abs(math.log(ticks[i]))) if ticks else 0  # keep 1× (or nearest)
    return [float(f"{t:.6g}") for i, t in enumerate(ticks) if (i - anchor) % step == 0]


def _ratio_y(ax, values) -> None:
    """A log-scale speed-up axis over ``values`` (1 always in range), labelled with :func:`ratio_ticks`."""
    v = np.asarray([x for x in values if np.isfinite(x) and x > 0] + [1.0], dtype=float)
    pad = max((v.max() / v.min()) ** 0.06, 1.03)
    lo, hi = v.min() / pad, v.max() * pad
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(FixedLocator(ratio_ticks(lo, hi)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.4g}×"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _legend(fig: MplFigure, handles: list, max_cols: int = 4) -> None:
    if not handles:
        return
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), max_cols), frameon=False)


def label(name: str, width: int = 40) -> str:
    """An implementation name as figure text: ``$`` not read as mathtext, long plug-in paths shortened."""
    if len(name) > width:
        keep = width - 1
        name = name[:keep // 3] + "…" + name[-(keep - keep // 3):]
    return name.replace("$", r"\$")


def _impl_handle(name: str, style: dict, **kw) -> Line2D:
    return Line2D([], [], color=style["color"], marker=style["marker"], label=label(name), **kw)


def _empty_panel(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#666", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _quantiles(samples: list, q: float, fallback: float) -> float:
    return float(np.quantile(samples, q)) if len(samples) >= 2 else fallback


def _chunks(items: list, size: int = MAX_PANELS) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)] or [[]]


def _suffix(i: int, n: int) -> str:
    return "" if n == 1 else f"-{i + 1}"


def _suptitle(fig: MplFigure, axes: list, text: str) -> None:
    """The figure title; with one panel, the panel's own title is dropped when the figure title says it all."""
    text = text.replace("$", r"\$")
    if len(axes) == 1:
        if axes[0].get_title() and axes[0].get_title() in text:
            axes[0].set_title("")
        if len(text) > 62 and " — " in text:
            text = text.replace(" — ", "\n", 1)
    fig.suptitle(text, fontsize=12)


def _title(base: str, df: pd.DataFrame, i: int, n: int) -> str:
    common = an.common_label(df)
    return base + (f" — {common}" if common else "") + (f" (part {i + 1} of {n})" if n > 1 else "")


@dataclass
class _Seen:
    """What the panels of one figure drew, for its legend: implementations, and marks such as ``"failed"``."""

    impls: set[str] = field(default_factory=set)
    marks: set[str] = field(default_factory=set)


def _paneled(name: str, title: str, title_df: pd.DataFrame, panels: list[an.Group],
             draw: Callable[[object, an.Group, _Seen], str | None], handles: Callable[[_Seen], list], caption: str,
             out_dir: Path, max_cols: int = 4, notes: Callable[[int, int], list[str]] | None = None) -> list[Figure]:
    """One panel per group, :data:`MAX_PANELS` to a figure (``name``, or ``name-1``, ``name-2``, … when split).

    ``draw(ax, group, seen)`` draws a panel under its title and records in ``seen`` what it drew; when there
    is nothing to draw it returns the note to show instead. ``handles(seen)`` gives the figure's legend,
    ``notes(i, n)`` the notes of figure ``i`` of ``n``; ``title_df`` supplies the title's common axes.
    """
    chunks = _chunks(panels)
    out = []
    for ci, chunk in enumerate(chunks):
        fig, axes = _new_figure(len(chunk))
        seen = _Seen()
        for ax, g in zip(axes, chunk, strict=True):
            ax.set_title(label(g.label, 80))
            empty_note = draw(ax, g, seen)
            if empty_note:
                _empty_panel(ax, empty_note)
        _legend(fig, handles(seen), max_cols)
        t = _title(title, title_df, ci, len(chunks))
        _suptitle(fig, axes, t)
        fname = f"{name}{_suffix(ci, len(chunks))}"
        png, svg, uri = _save(fig, out_dir, fname)
        out.append(Figure(fname, t, caption, png, svg, uri, notes=notes(ci, len(chunks)) if notes else []))
    return out


# ---------------------------------------------------------------- figures


@_styled
def latency(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[Figure]:
    """Median latency vs T per implementation, log-log, one panel per configuration; IQR band; failures marked."""
    ok = an.ok_rows(df)
    if ok.empty:
        return [Figure("latency", "Latency vs sequence length", skipped="no successful cells to plot")]
    all_groups = an.groups(df)
    gs = [g for g in all_groups if (g.rows["status"] == "ok").any()]
    empty = [g.full_label for g in all_groups if not (g.rows["status"] == "ok").any()]

    def notes(ci, n):
        out = []
        if empty and ci == n - 1:
            out.append(f"Not drawn: {len(empty)} configuration(s) without any successful cell "
                       f"({'; '.join(empty[:6])}{' …' if len(empty) > 6 else ''}); see the failed cells list.")
        if ok["seq_len"].nunique() == 1:
            out.append("Only one sequence length was measured, so each line is a single point; the bar chart "
                       "below compares the implementations at that length.")
        return out

    return _paneled("latency", "Latency vs sequence length", df, gs,
                    lambda ax, g, seen: _latency_panel(ax, g, seen, styles),
                    lambda seen: _latency_handles(seen, styles),
                    "Median time per call (lines); band: interquartile range of the per-call samples. Black rings "
                    "mark noisy cells; × on the x axis marks a cell that failed. Skipped cells (combinations that "
                    "cannot run here) are left out; the failed and skipped cells list names them.", out_dir, notes=notes)


def _latency_panel(ax, g: an.Group, seen: _Seen, styles: dict) -> str | None:
    """One configuration of :func:`latency`: a line per implementation with its IQR band, noisy cells ringed, failed
    cells as × on the x axis (None; the note to show instead when nothing succeeded)."""
    rows = g.rows
    good = an.ok_rows(rows)
    if good.empty:
        return "no successful cells here\n(see the failed cells list)"
    for impl in an.impl_order(good):
        st = styles[impl]
        r = good[good["impl"] == impl].sort_values("seq_len")
        lo = [_quantiles(s, 0.25, m - iq / 2 if np.isfinite(iq) else m)
              for s, m, iq in zip(r["samples_s"], r["median_s"], r["iqr_s"], strict=True)]
        hi = [_quantiles(s, 0.75, m + iq / 2 if np.isfinite(iq) else m)
              for s, m, iq in zip(r["samples_s"], r["median_s"], r["iqr_s"], strict=True)]
        ax.plot(r["seq_len"], r["median_s"], color=st["color"], marker=st["marker"], label=impl)
        ax.fill_between(r["seq_len"], lo, hi, color=st["color"], alpha=0.18, linewidth=0)
        nz = r[r["noise_rel"] > an.NOISY_CI_REL]
        if len(nz):
            seen.marks.add("noisy")
            ax.scatter(nz["seq_len"], nz["median_s"], s=110, facecolors="none", edgecolors="black",
                       linewidths=1.1, zorder=5)
        seen.impls.add(impl)
    if (rows["status"] == "skipped").any():  # impossible here by design, not a failure: not drawn
        seen.marks.add("skipped")
    for r in rows[~rows["status"].isin(["ok", "skipped"])].itertuples():
        seen.marks.add("failed")
        ax.plot([r.seq_len], [0.03], transform=ax.get_xaxis_transform(), marker="x",
                color=styles[r.impl]["color"], markersize=7, mew=2, linestyle="none", clip_on=False)
        seen.impls.add(r.impl)
    _seq_axis(ax, rows["seq_len"])
    _log_y(ax, np.concatenate([good["median_s"].to_numpy(), good["ci_high_s"].to_numpy()]), an.fmt_time)
    ax.set_ylabel("median time per call")
    return None


def _latency_handles(seen: _Seen, styles: dict) -> list:
    """:func:`latency`'s legend: the implementations drawn, then the marks used."""
    out = [_impl_handle(i, styles[i]) for i in sorted(seen.impls)]
    if "noisy" in seen.marks:
        out.append(Line2D([], [], marker="o", markersize=10, markerfacecolor="none", markeredgecolor="black",
                          linestyle="none", label=f"noisy: CI > ±{an.NOISY_CI_REL:.0%}"))
    if "failed" in seen.marks:
        out.append(Line2D([], [], marker="x", color="#444", mew=2, linestyle="none",
                          label="failed cell (oom/error/timeout/invalid)"))
    if "skipped" in seen.marks:
        out.append(Line2D([], [], linestyle="none", label="skipped cells (cannot run here): left out"))
    return out


HEATMAP_MIN_IMPLS = 7
"""From this many implementations on, speed-ups are a heatmap (implementation x shape): lines would cross unreadably."""
HEATMAP_MAX_COLUMNS = 12


@_styled
def speedup(df: pd.DataFrame, sp: pd.DataFrame, baseline: str | None, styles: dict, out_dir: Path) -> list[Figure]:
    """Speed-up over the baseline per configuration: lines vs T with their paired CI as a band for a few
    implementations; from :data:`HEATMAP_MIN_IMPLS` on a heatmap of implementation x shape (:func:`speedup_heatmap`)."""
    title = f"Speed-up relative to {label(baseline)}" if baseline else "Speed-up relative to a baseline"
    if baseline is None:
        return [Figure("speedup", title, skipped="no successful cells, so there is no baseline")]
    others = sp[sp["impl"] != baseline]
    if others.empty:
        only = sp["impl"].nunique() <= 1 and an.ok_rows(df)["impl"].nunique() <= 1
        why = ("only one implementation has successful cells" if only else
               f"no other implementation has a successful cell at a configuration where {baseline} has one")
        return [Figure("speedup", title, skipped=why)]
    if sp["impl"].nunique() >= HEATMAP_MIN_IMPLS:
        return speedup_heatmap(df, sp, baseline, out_dir)
    gs = an.groups(an.ok_rows(df))  # the same groups (and indices) as analysis.speedups
    # one panel per group with speed-ups, its rows replaced by those speed-ups
    panels = [replace(g, rows=sp[sp["group"] == gi]) for gi, g in enumerate(gs) if gi in set(sp["group"])]
    method = an.speedup_method(sp)

    def draw(ax, g, seen):
        part = g.rows
        ax.axhline(1.0, color=styles[baseline]["color"], linestyle="--", linewidth=1.2)
        rest = part[part["impl"] != baseline]
        if rest.empty:
            return f"only {baseline} has successful cells here"
        vals = [1.0]
        for impl in an.impl_order(rest):
            r = rest[rest["impl"] == impl].sort_values("seq_len")
            st = styles[impl]
            ax.plot(r["seq_len"], r["speedup"], color=st["color"], marker=st["marker"])
            band = r[r["paired"] & np.isfinite(r["speedup_ci_low"])]
            if len(band):
                seen.marks.add("ci")
                ax.fill_between(band["seq_len"], band["speedup_ci_low"], band["speedup_ci_high"], color=st["color"],
                                alpha=0.2, linewidth=0)
                vals += [*band["speedup_ci_low"], *band["speedup_ci_high"]]
            shaky = r[r["unstable"]]
            if len(shaky):
                seen.marks.add("unstable")
                ax.scatter(shaky["seq_len"], shaky["speedup"], s=110, facecolors="none", edgecolors="black",
                           linewidths=1.1, linestyle="--", zorder=5)
            vals += list(r["speedup"])
            seen.impls.add(impl)
        _seq_axis(ax, part["seq_len"])
        _ratio_y(ax, vals)
        ax.set_ylabel(f"speed-up vs {label(baseline, 24)} (>1 faster)")

    def handles(seen):
        out = [*(_impl_handle(i, styles[i]) for i in sorted(seen.impls)),
               Line2D([], [], color=styles[baseline]["color"], linestyle="--", label=f"{label(baseline)} (baseline, 1×)")]
        if "ci" in seen.marks:
            out.append(Patch(color="#888", alpha=0.3, label="paired 95% CI"))
        if "unstable" in seen.marks:
            out.append(Line2D([], [], marker="o", markersize=10, markerfacecolor="none", markeredgecolor="black",
                              linestyle="none", label="unstable: may move between runs"))
        return out

    return _paneled("speedup", title, df, panels, draw, handles, _speedup_caption(baseline, method), out_dir)


def _speedup_caption(baseline: str, method: str) -> str:
    paired = (f"Paired speed-ups: {baseline} time / implementation time, from bursts of the two timed in "
              "alternation (drift they share cancels), with their 95% CI.")
    medians = (f"{baseline} median / implementation median at the same cell (ratio of medians, no CI: this run has "
               "no paired speed-ups against this baseline).")
    text = {"paired": paired, "medians": medians, "mixed": paired + " Where a cell has none: " + medians}[method]
    return text + " Above 1 (the dashed line) is faster than the baseline, below is slower."


@_styled
def speedup_heatmap(df: pd.DataFrame, sp: pd.DataFrame, baseline: str, out_dir: Path) -> list[Figure]:
    """Speed-ups as a heatmap (:func:`attnbench.report.analysis.speedup_grid`): a row per implementation (ordered
    by geometric mean, fastest on top), a column per shape, each cell annotated with the speed-up and its paired
    CI; colour: log2 speed-up, diverging at 1. :data:`HEATMAP_MAX_COLUMNS` columns to a figure."""
    title = f"Speed-up relative to {label(baseline)}"
    grid = an.speedup_grid(df, sp, baseline)
    values = grid.speedup.to_numpy(dtype=float)
    span = float(np.nanmax(np.abs(np.log2(values)))) or 1.0
    cmap = matplotlib.colormaps["RdBu"]
    norm = matplotlib.colors.Normalize(vmin=-span, vmax=span)
    chunks = _chunks(list(range(values.shape[1])), HEATMAP_MAX_COLUMNS)
    method = an.speedup_method(sp)
    out = []
    for ci, chunk in enumerate(chunks):
        logs = np.log2(values[:, chunk])
        fig = MplFigure(figsize=(max(6.0, 1.25 * len(chunk) + 3.2), 1.4 + 0.5 * len(grid.speedup)), layout="constrained")
        ax = fig.add_subplot(1, 1, 1)
        ax.imshow(np.ma.masked_invalid(logs), cmap=cmap, norm=norm, aspect="auto")
        for i in range(logs.shape[0]):
            for j, col in enumerate(chunk):
                dark = np.isfinite(logs[i, j]) and abs(logs[i, j]) > 0.6 * span
                ax.text(j, i, grid.text.iat[i, col], ha="center", va="center", fontsize=7.5, linespacing=1.1,
                        color="white" if dark else "black" if np.isfinite(logs[i, j]) else "#666",
                        in_layout=False)  # inside its cell, so inside the axes: nothing for the layout to measure
        ax.set_xticks(range(len(chunk)), [grid.labels[c] for c in chunk], fontsize=8)
        ax.set_yticks(range(len(grid.speedup)), [label(i, 28) for i in grid.speedup.index])
        ax.grid(False)
        ax.tick_params(length=0)
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
        bar = fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8)
        bar.set_label(f"speed-up vs {label(baseline, 24)}")
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{2 ** v:.3g}×"))
        t = _title(title, df, ci, len(chunks))
        fig.suptitle(t.replace("$", r"\$"), fontsize=12)
        fname = f"speedup{_suffix(ci, len(chunks))}"
        png, svg, uri = _save(fig, out_dir, fname)
        caption = (_speedup_caption(baseline, method) + " Each cell: speed-up, and below it its 95% CI where it "
                   "is paired; rows ordered by geometric-mean speed-up (fastest on top); blue faster, red slower.")
        out.append(Figure(fname, t, caption, png, svg, uri, kind="heatmap"))
    return out


def _metric_panels(df: pd.DataFrame, column: str, name: str, title: str, ylabel: str, fmt, styles: dict,
                   out_dir: Path, caption: str, empty_reason: str, base: int = 10,
                   decorate: Callable | None = None) -> list[Figure]:
    ok = an.ok_rows(df)
    vals = ok[np.isfinite(ok[column]) & (ok[column] > 0)]
    if vals.empty:
        return [Figure(name, title, skipped=empty_reason)]
    gs = [g for g in an.groups(df) if (g.rows["status"] == "ok").any()]

    def draw(ax, g, seen):
        good = an.ok_rows(g.rows)
        good = good[np.isfinite(good[column]) & (good[column] > 0)]
        if good.empty:
            return f"no {column} measured here"
        for k, impl in enumerate(an.impl_order(good)):
            r = good[good["impl"] == impl].sort_values("seq_len")
            st = styles[impl]
            # hollow markers, later lines thinner: implementations with identical values stay visible
            ax.plot(r["seq_len"], r[column], color=st["color"], marker=st["marker"], markerfacecolor="none",
                    markersize=7 - min(k, 4) * 0.6, markeredgewidth=1.4, linewidth=2.2 - min(k, 5) * 0.25)
            seen.impls.add(impl)
        _seq_axis(ax, g.rows["seq_len"])
        _log_y(ax, good[column], fmt, base=base)
        ax.set_ylabel(ylabel)
        if decorate:
            decorate(ax, good)

    def handles(seen):
        return ([_impl_handle(i, styles[i], markerfacecolor="none") for i in sorted(seen.impls)]
                + list(getattr(decorate, "handles", [])))

    return _paneled(name, title, df, gs, draw, handles, caption, out_dir)


@_styled
def memory(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[Figure]:
    """Peak memory over the pre-cell baseline vs T."""
    methods = sorted({m for m in df.get("memory_method", pd.Series(dtype=str)).dropna().astype(str) if m})
    how = f" (measured with: {', '.join(methods)})" if methods else ""
    return _metric_panels(df, "peak_bytes", "memory", "Peak memory vs sequence length", "peak memory over baseline",
                          an.fmt_bytes, styles, out_dir,
                          f"Peak memory allocated during a call, above what was allocated before the cell{how}.",
                          "no successful cell has a peak memory measurement" + how, base=2)


@_styled
def throughput(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[Figure]:
    """Achieved GFLOP/s vs T, with the measured peak as a dashed line and a fraction-of-peak axis on the right."""

    def decorate(ax, good):
        peaks = good["peak_gflops_per_s"].dropna()
        peaks = peaks[peaks > 0]
        if peaks.empty:
            return
        peak = float(peaks.median())
        ax.axhline(peak, color="#555", linestyle=":", linewidth=1.3)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, max(hi, peak * 1.3))
        sec = ax.secondary_yaxis("right", functions=(lambda g: g / peak, lambda f: f * peak))
        sec.set_ylabel("fraction of measured peak")
        sec.yaxis.set_major_formatter(FuncFormatter(lambda f, _: f"{f:.0%}" if f >= 0.01 else f"{f:.1%}"))
        sec.yaxis.set_minor_formatter(NullFormatter())

    decorate.handles = [Line2D([], [], color="#555", linestyle=":", label="measured peak GFLOP/s")]
    return _metric_panels(df, "gflops_per_s", "throughput", "Achieved throughput vs sequence length", "GFLOP/s",
                          lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}", styles, out_dir,
                          "Model FLOPs per call / median time. Dotted line: the machine's measured peak for that "
                          "device and dtype (right axis: fraction of it, the frac_peak column).",
                          "no successful cell has a FLOP count (gflops_per_s is empty)", decorate=decorate)


@_styled
def compile_times(df: pd.DataFrame, styles: dict, out_dir: Path) -> list[Figure]:
    """``compiled:`` cells: compile time (solid) against steady-state time per call (dashed) vs T."""
    ok = an.ok_rows(df)
    comp = ok[ok["impl"].str.startswith("compiled:")]
    title = "torch.compile: compile time vs steady-state time"
    if comp.empty:
        why = ("this run has no compiled: implementations" if not df["impl"].str.startswith("compiled:").any()
               else "no compiled: cell succeeded")
        return [Figure("compile", title, skipped=why)]

    def draw(ax, g, seen):
        vals = []
        for impl in an.impl_order(g.rows):
            r = g.rows[g.rows["impl"] == impl].sort_values("seq_len")
            st = styles[impl]
            if r["compile_s"].notna().any():
                ax.plot(r["seq_len"], r["compile_s"], color=st["color"], marker="s", linestyle="-")
            ax.plot(r["seq_len"], r["median_s"], color=st["color"], marker="o", linestyle="--",
                    markerfacecolor="white")
            vals += [*r["compile_s"].dropna(), *r["median_s"].dropna()]
            seen.impls.add(impl)
        _seq_axis(ax, g.rows["seq_len"])
        _log_y(ax, vals, an.fmt_time)
        ax.set_ylabel("time")

    def handles(seen):
        return [*(Patch(color=styles[i]["color"], label=label(i)) for i in sorted(seen.impls)),
                Line2D([], [], color="#444", marker="s", linestyle="-", label="compile time (first call)"),
                Line2D([], [], color="#444", marker="o", markerfacecolor="white", linestyle="--",
                       label="steady-state time per call")]

    return _paneled("compile", title, comp, an.groups(comp), draw, handles,
                    "Solid: time to compile (the first call); dashed: median time per call after compilation. "
                    "The table below gives the number of calls after which compiling pays off.", out_dir, max_cols=3)


@_styled
def bars(df: pd.DataFrame, baseline: str | None, styles: dict, out_dir: Path) -> tuple[Figure, pd.DataFrame]:
    """Median latency per implementation at one configuration (horizontal bars, CI error bars)."""
    choice = an.bar_choice(df)
    if choice is None:
        return Figure("bars", "Implementations side by side", skipped="no successful cells to compare"), pd.DataFrame()
    g, t = choice
    cells = g.rows[g.rows["seq_len"] == t].sort_values("median_s", ascending=False)
    title = f"All implementations at T={t}, {g.full_label}"  # axis values only: no mathtext risk
    scale, unit = an.time_unit(cells["median_s"].max())
    med = cells["median_s"].to_numpy() / scale
    lo = np.nan_to_num(med - cells["ci_low_s"].to_numpy() / scale, nan=0.0).clip(min=0)
    hi = np.nan_to_num(cells["ci_high_s"].to_numpy() / scale - med, nan=0.0).clip(min=0)
    fig = MplFigure(figsize=(8.0, 1.2 + 0.42 * len(cells)), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(len(cells))
    ax.barh(y, med, xerr=[lo, hi], color=[styles[i]["color"] for i in cells["impl"]], capsize=3,
            error_kw={"elinewidth": 1.1, "ecolor": "#222"})
    ax.set_yticks(y, [label(i) for i in cells["impl"]])
    ax.grid(axis="y", visible=False)
    base_med = cells.loc[cells["impl"] == baseline, "median_s"]
    for yi, (m, h, r) in enumerate(zip(med, hi, cells.itertuples(), strict=True)):
        text = f" {m:.3g} {unit}"
        paired = str(getattr(r, "baseline", "") or "") == baseline and np.isfinite(getattr(r, "speedup", np.nan))
        if paired and r.impl != baseline:  # the paired speed-up, measured in alternation with the baseline
            text += f"  ({r.speedup:.2f}× vs {label(baseline, 24)}, paired)"
        elif len(base_med) and r.impl != baseline:
            text += f"  ({float(base_med.iloc[0]) / (m * scale):.2f}× vs {label(baseline, 24)})"
        ax.text(m + h, yi, text, va="center", fontsize=8.5)
    ax.set_xlim(0, (med + hi).max() * 1.45)
    ax.set_xlabel(f"median time per call ({unit}); error bars: 95% CI of the median")
    fig.suptitle(label(title, 200), fontsize=11)
    png, svg, uri = _save(fig, out_dir, "bars")
    others = g.rows.groupby("seq_len")["impl"].nunique()
    table = pd.DataFrame({"impl": cells["impl"][::-1].tolist(),
                          "median": [an.fmt_time(v) for v in cells["median_s"][::-1]],
                          "ci_low": [an.fmt_time(v) for v in cells["ci_low_s"][::-1]],
                          "ci_high": [an.fmt_time(v) for v in cells["ci_high_s"][::-1]],
                          "n": cells["n"][::-1].tolist()})
    caption = (f"Chosen automatically: the largest sequence length measured by the most implementations "
               f"({int(others.max())}) in the first configuration. Bars: median; error bars: 95% CI.")
    return Figure("bars", title, caption, png, svg, uri), table


@_styled
def latency_overlay(a: pd.DataFrame, b: pd.DataFrame, label_a: str, label_b: str, styles: dict,
                    out_dir: Path, name: str = "latency_overlay") -> list[Figure]:
    """Two runs' latency curves on the same panels: A solid with filled markers, B dashed with hollow ones."""
    both = pd.concat([a.assign(_run="A"), b.assign(_run="B")], ignore_index=True)
    ok = an.ok_rows(both)
    title = "Latency vs sequence length, A (solid) and B (dashed)"
    if ok.empty:
        return [Figure(name, title, skipped="neither run has a successful cell")]
    gs = [g for g in an.groups(both) if (g.rows["status"] == "ok").any()]

    def draw(ax, g, seen):
        good = an.ok_rows(g.rows)
        if good.empty:
            return "no successful cells here in either run"
        for impl in an.impl_order(good):
            st = styles[impl]
            for run, ls, face in (("A", "-", st["color"]), ("B", "--", "white")):
                r = good[(good["impl"] == impl) & (good["_run"] == run)].sort_values("seq_len")
                if len(r):
                    ax.plot(r["seq_len"], r["median_s"], color=st["color"], marker=st["marker"], linestyle=ls,
                            markerfacecolor=face)
            seen.impls.add(impl)
        _seq_axis(ax, g.rows["seq_len"])
        _log_y(ax, good["median_s"], an.fmt_time)
        ax.set_ylabel("median time per call")

    def handles(seen):
        return [*(_impl_handle(i, styles[i]) for i in sorted(seen.impls)),
                Line2D([], [], color="#444", linestyle="-", marker="o", label=f"A: {label(label_a)}"),
                Line2D([], [], color="#444", linestyle="--", marker="o", markerfacecolor="white",
                       label=f"B: {label(label_b)}")]

    return _paneled(name, title, both, gs, draw, handles,
                    "Median time per call; A solid with filled markers, B dashed with hollow markers.", out_dir)
