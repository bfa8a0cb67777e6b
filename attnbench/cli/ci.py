"""``attnbench ci github``: write a GitHub Actions workflow (see :mod:`attnbench.tools.ci_workflow`)."""

from __future__ import annotations

from pathlib import Path

import click

from attnbench.cli.app import _split, cli, console, err_console


@cli.group("ci")
def ci_group() -> None:
    """Continuous-integration workflows that run attnbench on a project's pull requests."""


@ci_group.command("github")
@click.option("--impl", "impls", multiple=True, help="Implementation(s) to check and time, comma-separated; default all available.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Where to write it. [default: .github/workflows/attnbench.yml]")
@click.option("--python", default="3.11", show_default=True, help="Python version of the job.")
@click.option("--torch", default="torch", show_default=True, help="pip requirement for PyTorch (CPU wheels), e.g. torch==2.5.1.")
@click.option("--preset", default="smoke", show_default=True, help="Sweep preset timed on the base branch and the PR head.")
@click.option("--factor", type=float, default=1.2, show_default=True, help="asv gate: ratio beyond which a slowdown fails.")
@click.option("--force", is_flag=True, help="Overwrite an existing, different workflow file.")
@click.option("--stdout", "to_stdout", is_flag=True, help="Print the workflow instead of writing it.")
@click.option("--attnbench-source", "source", default=None,
              help="Where the workflow installs attnbench from: a git URL, a path in the repository or a requirement "
                   "string. [default: the repository itself when it is attnbench, else where this attnbench came from "
                   "(git), else attnbench's home repository]")
@click.option("--instr-threshold", "instr_threshold", type=float, default=None,
              help="Instruction gate: more instructions per call than this fraction fails the pull request. [default: "
                   "each cell's from its counts' recorded repeat spread (attnbench compare's default); the asv gate 1%]")
def github_cmd(impls, output, python, torch, preset, factor, force, to_stdout, source, instr_threshold) -> None:
    """Write a GitHub Actions workflow: on pull requests, check, sweep, count instructions, compare and gate on
    instruction counts and asv; upload the pages."""
    from attnbench.tools import ci_workflow

    repo = Path(".")
    options = dict(impls=_split(impls), python=python, torch=torch, preset=preset, factor=factor,
                   attnbench_source=source, instr_threshold=instr_threshold, repo=repo)
    for warning in ci_workflow.missing_files(repo):
        err_console.print(f"warning: {warning}", markup=False)
    if source is None:
        where, why = ci_workflow.default_source(repo)
        err_console.print(f"note: the workflow installs attnbench from {where} ({why})", markup=False)
    if to_stdout:
        click.echo(ci_workflow.render(**options), nl=False)
        return
    path = ci_workflow.write(output or ci_workflow.DEFAULT_PATH, force=force, **options)
    console.print(f"wrote {path}: commit it; it runs on the next pull request", markup=False)
