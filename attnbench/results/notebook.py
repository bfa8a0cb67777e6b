"""attnbench in a notebook: results that are DataFrames and show themselves as the console does.

:func:`attnbench.run` returns :class:`RunResults` and :func:`attnbench.check` :class:`CheckResults`: pandas
DataFrames (every DataFrame operation works and returns a plain DataFrame) that Jupyter renders as the
console's summary table (``_repr_html_``, the rich table exported to HTML), with the headline speed-ups for a
run. ``results.plot("speedup")`` draws the report's figures (:mod:`attnbench.report.figures`) inline and
``results.report()`` writes the HTML report. In a Jupyter kernel both calls show a tqdm progress bar
(:func:`notebook_progress`; the notebook widget with ipywidgets, plain text without).
"""

from __future__ import annotations

import html
import io
import tempfile
from pathlib import Path

import pandas as pd
from rich.console import Console

from attnbench.errors import ResultsError

PLOTS = ("latency", "speedup", "heatmap", "memory", "throughput", "compile", "bars")
"""What :meth:`RunResults.plot` draws: the report's figure sections, and the speed-ups as a heatmap."""


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def notebook_progress(unit: str, total: int | None = None):
    """A progress callback drawing a tqdm bar (``tqdm.auto``: the notebook widget where ipywidgets is installed),
    or None when tqdm is not installed (``pip install 'attnbench[notebook]'``)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    bar = tqdm(unit=unit, desc="attnbench", total=total, leave=True)

    def on_sweep(i, total, cell, row):  # attnbench.run: (i, n, cell, row), row None before the cell
        bar.total = total
        bar.n = i if row is None else i + 1
        bar.set_postfix_str(cell.cell_id if row is None else f"{cell.cell_id} -> {row['status']}", refresh=True)
        if row is not None and bar.n >= total:
            bar.close()

    def on_case(result):  # attnbench.check: one CaseResult each
        bar.update(1)
        bar.set_postfix_str(f"{result.impl} {result.kind}: {result.status}", refresh=False)

    return on_sweep if unit == "cell" else on_case


def _rich_html(*renderables) -> str:
    """Rich renderables as the HTML a notebook shows (styles inline, no terminal escape codes)."""
    console = Console(record=True, width=200, file=io.StringIO(), force_jupyter=False)
    for r in renderables:
        console.print(r)
    return console.export_html(inline_styles=True, code_format='<pre style="font-family: monospace">{code}</pre>')


class _Results(pd.DataFrame):
    """A DataFrame whose operations return plain DataFrames (only the whole result shows itself as a summary)."""

    @property
    def _constructor(self):
        return pd.DataFrame

    @classmethod
    def of(cls, df: pd.DataFrame):
        out = cls(df)
        out.attrs = dict(df.attrs)
        return out


class CheckResults(_Results):
    """:func:`attnbench.check`'s rows (one per case); shows the check's summary table, failures and verdicts."""

    def _repr_html_(self) -> str:
        from attnbench.cli.check import matrix_table, summary_line
        from attnbench.correctness.matrix import case_line

        if self.empty:
            return "<p>attnbench check: no cases</p>"
        device = ", ".join(dict.fromkeys(self["device"].astype(str)))
        lines = [case_line(r) for r in self[self.status.isin(["fail", "error"])].itertuples()]
        lines += [summary_line(impl, rows) for impl, rows in self.groupby("impl", sort=False)]
        return _rich_html(matrix_table(self, device)) + "<pre>" + html.escape("\n".join(lines)) + "</pre>"


class RunResults(_Results):
    """:func:`attnbench.run`'s rows (one per cell); shows the console's summary table and the headline speed-ups;
    :meth:`plot` draws the report's figures, :meth:`report` writes its HTML page."""

    def headline(self, baseline: str | None = None) -> list[str]:
        """One line per implementation: its geometric-mean speed-up over the baseline across the run's cells."""
        from attnbench.report import analysis as an

        df, chosen = self._prepared(baseline)
        sp = an.speedups(df, chosen)
        means = an.geometric_mean_speedups(sp[sp["impl"] != chosen]) if len(sp) else pd.Series(dtype=float)
        how = an.speedup_method(sp[sp["impl"] != chosen]) if len(sp) else "medians"
        return [f"{impl}: {v:.2f}× vs {chosen} (geometric mean over {int((sp['impl'] == impl).sum())} cells, "
                f"{'paired' if how == 'paired' else 'ratio of medians'})" for impl, v in means.items()]

    def _prepared(self, baseline: str | None):
        from attnbench.report import analysis as an
        from attnbench.report.page import DEFAULT_BASELINE

        df = an.prepare(pd.DataFrame(self))
        chosen, _ = an.choose_baseline(df, baseline or an.paired_baseline(df) or DEFAULT_BASELINE)
        return df, chosen

    def _repr_html_(self) -> str:
        from attnbench.cli.run import summary_table

        if self.empty:
            return "<p>attnbench run: no cells</p>"
        title = f"attnbench run {self.attrs.get('run_id', '')}".strip()
        lines = self.headline()
        bad = [f"{r.status:8} {r.cell_id}: {r.error}" for r in self[self.status != "ok"].itertuples()]
        head = ("<p><b>speed-ups</b></p><ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in lines) + "</ul>") if lines else ""
        tail = "<pre>" + html.escape("\n".join(bad)) + "</pre>" if bad else ""
        return _rich_html(summary_table(pd.DataFrame(self), title)) + head + tail

    def plot(self, kind: str = "speedup", baseline: str | None = None) -> Figures:
        """The report's ``kind`` figure(s) (one of :data:`PLOTS`), drawn now and shown inline by Jupyter."""
        from attnbench.report import figures as figs

        if kind not in PLOTS:
            raise ResultsError(f"unknown plot {kind!r}; use one of {', '.join(PLOTS)}")
        df, chosen = self._prepared(baseline)
        with tempfile.TemporaryDirectory() as tmp, figs.rendering(figs.Render(svg=False)):
            out = Path(tmp)
            drawn = _draw(kind, df, chosen, figs.impl_styles(df["impl"].tolist()), out)
            for f in drawn:
                f.png = f.svg = None  # the files go with the temporary folder; the data URI stays
        return Figures(drawn)

    def report(self, out_dir: str | Path | None = None, baseline: str | None = None) -> Path:
        """Write the HTML report of this run (:func:`attnbench.report.build_report`) and return its path."""
        from attnbench.report import build_report

        run_dir = self.attrs.get("run_dir")
        if not run_dir:
            raise ResultsError("these results have no run folder (attrs['run_dir']); `attnbench report RESULTS` needs one")
        return build_report(run_dir, out_dir=out_dir, baseline=baseline)


def _draw(kind: str, df: pd.DataFrame, baseline: str | None, styles: dict, out: Path) -> list:
    from attnbench.report import analysis as an
    from attnbench.report import figures as figs

    if kind in ("speedup", "heatmap"):
        sp = an.speedups(df, baseline)
        if kind == "heatmap" and baseline is not None and (sp["impl"] != baseline).any():
            return figs.speedup_heatmap(df, sp, baseline, out)
        return figs.speedup(df, sp, baseline, styles, out)
    if kind == "bars":
        return [figs.bars(df, baseline, styles, out)[0]]
    draw = {"latency": figs.latency, "memory": figs.memory, "throughput": figs.throughput, "compile": figs.compile_times}
    return draw[kind](df, styles, out)


class Figures(list):
    """Report figures (:class:`attnbench.report.figures.Figure`) that Jupyter shows inline: each PNG with its
    title and caption, or the reason it was not drawn."""

    def _repr_html_(self) -> str:
        parts = []
        for f in self:
            if f.skipped:
                parts.append(f"<p><b>{html.escape(f.title)}</b>: not drawn ({html.escape(f.skipped)})</p>")
            else:
                parts.append(f'<figure><img src="{f.data_uri}" alt="{html.escape(f.title)}" style="max-width:100%">'
                             f"<figcaption>{html.escape(f.caption)}</figcaption></figure>")
        return "".join(parts)

    def _repr_png_(self) -> bytes | None:
        import base64

        first = next((f for f in self if f.data_uri), None)
        return base64.b64decode(first.data_uri.partition(",")[2]) if first else None
