"""``attnbench report`` and ``attnbench compare`` (registered on :data:`attnbench.cli.cli` on import)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click
import numpy as np
from rich.table import Table

from attnbench.cli.app import cli, console, err_console


@cli.command("report")
@click.argument("results", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Output folder. [default: the run's own report folder (<run folder>/report) when it has one, "
                   "else reports/<run-id>/, where `attnbench run` put it]")
@click.option("--baseline", default=None,
              help="Implementation the speed-ups are relative to. [default: the run's own baseline (paired speed-ups), "
                   "else weight_split; the first one present if it is missing]")
def report_cmd(results: Path, out_dir: Path | None, baseline: str | None) -> None:
    """Figures, analysis and one self-contained HTML page for a run.

    RESULTS is a run folder (results/<run-id>) or its results.parquet. Writes report.html (figures
    embedded, opens from disk), figures/*.png|svg and tables/*.csv|md.
    """
    from attnbench.report import build_report
    from attnbench.results.store import the_run

    results = the_run(results)  # a folder holding one run folder is that run
    with console.status("building the report ..."):
        path = build_report(results, out_dir=out_dir or own_report_dir(results), baseline=baseline)
    console.print(f"report: {path}", markup=False)
    console.print(f"open it with: xdg-open {path}  (or any browser; it needs no server)", markup=False)


def own_report_dir(results: Path) -> Path | None:
    """The report folder the run already has (``<run folder>/report``), so that a new report replaces it rather than
    adding a second copy under ``reports/``; None: the default (``reports/<run-id>``, where `attnbench run` wrote it)."""
    run = results if results.is_dir() else results.parent
    return run / "report" if (run / "report").is_dir() else None


def _default_compare_dir(label_a: str, label_b: str) -> Path:
    slug = lambda s: re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "run"  # noqa: E731
    return Path("reports") / f"compare-{slug(label_a)}-vs-{slug(label_b)}"


@cli.command("compare")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--threshold", default=0.10, show_default=True, type=float,
              help="Smallest slowdown that fails the comparison, as a fraction (0.10 = 10%).")
@click.option("--alpha", default=0.05, show_default=True, type=float, help="Significance level of the tests.")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Folder for compare.html and tables. [default: reports/compare-<A>-vs-<B>/]")
@click.option("--all", "show_all", is_flag=True, help="Print every matched cell, not just the changed ones.")
@click.option("--speedups", is_flag=True,
              help="Compare each implementation's paired speed-up against its baseline (B's over A's) instead of the "
                   "medians: drift of the machine between the runs cancels in it.")
@click.option("--error-ratio-limit", "error_ratio_limit", default=2.0, show_default=True, type=float,
              help="A cell whose error ratio (error against float64 over the plain math's in the same dtype) was at "
                   "most this in A and is above it in B is an accuracy regression: it fails the comparison too.")
@click.option("--no-run-shift", "no_run_shift", is_flag=True,
              help="Test each cell's ratio against 1, not against the shift every cell of the runs shares (the "
                   "machine's speed between the runs; estimated from 4 or more cells).")
# --- issue 39: the instruction layer (attnbench.cli.instructions.compare_counted) ---
@click.option("--instr-threshold", "instr_threshold", default=None, type=float,
              help="Runs counted with --metric instructions: the increase in instructions per call that fails (0.01 = "
                   "1%). [default: each cell's from the counts' recorded repeat spread: max(1 x spread, 0.1%), 1% for "
                   "runs counted without one; printed]")
# --- end issue 39 ---
def compare_cmd(a: Path, b: Path, threshold: float, alpha: float, out_dir: Path | None, show_all: bool,
                speedups: bool, error_ratio_limit: float = 2.0, instr_threshold: float | None = None,
                no_run_shift: bool = False) -> None:
    """Compare run B against run A cell by cell; exit 1 on a significant slowdown beyond --threshold, 3 when such a
    slowdown was timed under other load that could explain it (inconclusive: rerun), 2 when nothing was compared.

    A and B are run folders or results.parquet files. Each cell gets the ratio of medians B/A with a
    hierarchical bootstrap confidence interval and p-value (rounds and processes resampled, then samples).
    With --speedups, each implementation's paired speed-up against its baseline instead (B/A below 1: it lost
    ground), with a CI combining both runs' paired CIs.
    """
    from attnbench.cli.instructions import compare_counted
    from attnbench.results.accuracy import print_accuracy
    from attnbench.results.compare import compare_runs, write_compare_html
    from attnbench.results.store import the_run

    counted = compare_counted(the_run(a), the_run(b), instr_threshold)  # issue 39: runs of instruction counts compare by count
    if counted is not None:
        sys.exit(counted)
    with console.status("comparing ..."):
        result = compare_runs(a, b, threshold=threshold, alpha=alpha, speedups=speedups, run_shift=not no_run_shift)
        page = write_compare_html(result, out_dir or _default_compare_dir(result.label_a, result.label_b))
    cells = result.cells
    shown = cells if show_all else cells[cells["change"] != "no significant change"]
    if speedups:
        _print_speedup_table(result, shown, alpha)
    else:
        _print_time_table(result, shown, alpha)
    for r in cells[cells["unstable"]].itertuples() if "unstable" in cells else ():
        console.print(f"unstable {r.impl} T={r.seq_len} {r.mode}: {r.note}", markup=False)
    hidden = len(cells) - len(shown)
    if hidden:
        console.print(f"({hidden} cell(s) without a significant change not shown; --all prints them)")
    for name, only in (("A", result.only_in_a), ("B", result.only_in_b)):
        if only:
            console.print(f"{len(only)} cell(s) only in {name}, not compared (listed in the HTML page)", markup=False)
    for axis, d in result.axis_mismatch.items():
        console.print(f"axis {axis} differs: only in A {d['only_in_a'] or '-'}, only in B {d['only_in_b'] or '-'}",
                      markup=False)
    if len(result.status_changed):
        console.print(f"{len(result.status_changed)} cell(s) not ok in at least one run (listed in the HTML page)")
    for k, va, vb in result.env_diff:
        console.print(f"environment differs: {k}: A {va} / B {vb}", markup=False)
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    console.print(result.summary(), markup=False)
    lost_accuracy = print_accuracy(console, result.frames, error_ratio_limit)  # issue 38: the accuracy gate
    console.print(f"compare page: {page}", markup=False)
    _verdict(result, threshold, speedups, lost_accuracy, error_ratio_limit)


def _verdict(result, threshold: float, speedups: bool, lost_accuracy: int, error_ratio_limit: float) -> None:
    """The comparison's last line and exit status: 2 nothing compared, 1 a regression (time or accuracy), 3
    inconclusive (a slowdown the load in B can explain: issue 45), else OK (0)."""
    from attnbench.results.compare import EXIT_INCONCLUSIVE

    what = " relative to the baselines" if speedups else ""
    if not len(result.cells):  # a gate that compared nothing must not pass
        err_console.print(f"error: {_nothing_compared(result, speedups)}", markup=False)
        sys.exit(2)
    if result.has_regression:  # each failing kind says so, then one exit status
        console.print(f"[bold red]FAIL[/]: {len(result.regressions)} significant slowdown(s) beyond {threshold:.0%}{what}")
    if lost_accuracy:  # issue 38
        console.print(f"[bold red]FAIL[/]: {lost_accuracy} error ratio(s) grew past {error_ratio_limit:g} (accuracy)")
    if result.has_regression or lost_accuracy:
        sys.exit(1)
    if len(result.inconclusive):  # issue 45: a gate fails closed; the CI workflow reruns once, then fails
        err_console.print(f"INCONCLUSIVE (exit {EXIT_INCONCLUSIVE}): {len(result.inconclusive)} cell(s) read slower "
                          f"beyond {threshold:.0%} while other load took the CPUs, by no more than that load can "
                          "explain; time both runs again on a quieter machine", markup=False)
        sys.exit(EXIT_INCONCLUSIVE)
    console.print(f"[green]OK[/]: no significant slowdown beyond {threshold:.0%}{what}")


def _nothing_compared(result, speedups: bool) -> str:
    """Why a comparison compared no cell, and what to do."""
    if speedups:
        return ("no paired speed-up is in both runs, so nothing was compared; run both with the same baseline "
                "in the sweep, or compare the medians (without --speedups)")
    if result.only_in_a or result.only_in_b:
        return (f"the two runs share no timed cell ({len(result.only_in_a)} cell(s) only in A, {len(result.only_in_b)} "
                "only in B), so nothing was compared; run B with A's sweep (its axes are in A's meta.json)")
    return (f"no cell was timed (ok) in both runs ({len(result.status_changed)} failed in at least one), so nothing "
            "was compared")


def _print_speedup_table(result, shown, alpha: float) -> None:
    from attnbench.results.text import configuration_label, fmt_num, fmt_speedup

    table = Table(title=f"B ({result.label_b}) vs A ({result.label_a}): paired speed-ups against the baseline, "
                        f"ratio B/A (<1: lost ground) with a {1 - alpha:.0%} CI and p")
    for col in ("impl", "configuration", "T", "baseline", "A speed-up", "B speed-up", "B/A", "CI", "p", "change"):
        table.add_column(col, justify="right" if col in ("T", "B/A", "CI", "p") else "left", overflow="fold")
    for r in shown.itertuples():
        style = "bold red" if r.regression else "green" if r.improvement else None
        table.add_row(r.impl, configuration_label(r), str(r.seq_len), r.baseline,
                      fmt_speedup(r.speedup_a, r.speedup_a_low, r.speedup_a_high),
                      fmt_speedup(r.speedup_b, r.speedup_b_low, r.speedup_b_high),
                      fmt_num(r.ratio) + "×" if np.isfinite(r.ratio) else "–",
                      f"{fmt_num(r.ci_low)}–{fmt_num(r.ci_high)}" if np.isfinite(r.ci_low) else "–",
                      f"{r.p_value:.2g}" if np.isfinite(r.p_value) else "–",
                      r.change + (f" ({r.note})" if r.change == "untested" else ""), style=style)
    if len(shown):
        console.print(table)


def _print_time_table(result, shown, alpha: float) -> None:
    from attnbench.results.text import configuration_label, fmt_num, fmt_time

    table = Table(title=f"B ({result.label_b}) vs A ({result.label_a}): ratio of medians B/A, "
                        f"{1 - alpha:.0%} hierarchical bootstrap CI and p")
    for col in ("impl", "configuration", "T", "A median", "B median", "B/A", "CI", "p", "change"):
        table.add_column(col, justify="right" if col in ("T", "A median", "B median", "B/A", "CI", "p") else "left",
                         overflow="fold")
    for r in shown.itertuples():
        style = "bold red" if r.regression else "green" if r.improvement else None
        table.add_row(r.impl, configuration_label(r), str(r.seq_len), fmt_time(r.median_a),
                      fmt_time(r.median_b), fmt_num(r.ratio) + "×" if np.isfinite(r.ratio) else "–",
                      f"{fmt_num(r.ci_low)}–{fmt_num(r.ci_high)}" if np.isfinite(r.ci_low) else "–",
                      f"{r.p_value:.2g}" if np.isfinite(r.p_value) else "–", r.change, style=style)
    if len(shown):
        console.print(table)
