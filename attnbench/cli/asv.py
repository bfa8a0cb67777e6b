"""``attnbench asv-compare BASE HEAD``: the asv regression gate (see :mod:`attnbench.tools.asv_gate`)."""

from __future__ import annotations

import sys

import click

from attnbench.cli.app import cli


@cli.command("asv-compare")
@click.argument("base")
@click.argument("head")
@click.option("--factor", type=float, default=1.2, show_default=True,
              help="Ratio beyond which a significant change counts as a regression.")
@click.option("--bench", "-b", "bench", multiple=True, help="asv benchmark regex (repeatable); default all.")
@click.option("--rounds", type=int, default=2, show_default=True, help="Alternating BASE/HEAD asv runs per commit.")
@click.option("--confirm", type=int, default=2, show_default=True,
              help="Fresh alternating runs that must show a timed slowdown again before it fails the gate (0: none).")
@click.option("--python", default=None, help="The environment's interpreter (default: this one).")
@click.option("--repo", default=".", show_default=True, help="The git repository.")
@click.option("--config", default=None, help="asv config (default: REPO/asv.conf.json).")
@click.option("--keep", metavar="DIR", default=None, help="Copy asv's results to DIR/results.")
@click.option("--show-stderr", is_flag=True, help="Pass --show-stderr to asv run.")
@click.option("--instr-threshold", "instr_threshold", type=float, default=0.01, show_default=True,
              help="track_instructions (instruction counts) more than this fraction higher at HEAD fail the gate.")
def asv_compare_cmd(base, head, factor, bench, rounds, confirm, python, repo, config, keep, show_stderr,
                    instr_threshold) -> None:
    """Benchmark BASE and HEAD with asv and exit 1 on a significant slowdown beyond --factor, or on more
    instructions per call (track_instructions) beyond --instr-threshold.

    Each commit is installed into a private folder (pip --target) that only asv's processes see, so
    this environment's own install is never modified. Exit 2 when the gate cannot run.
    """
    from attnbench.tools.asv_gate import report, run_gate

    result = run_gate(base, head, repo=repo, factor=factor, bench=list(bench) or None, rounds=rounds, confirm=confirm,
                      python=python, config=config, keep=keep, show_stderr=show_stderr,
                      instr_threshold=instr_threshold)
    sys.stdout.flush()
    code = report(result, factor)
    if code:
        sys.exit(code)
