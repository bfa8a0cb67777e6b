"""``attnbench check``: the correctness matrix against the float64 reference."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from attnbench import registry
from attnbench.cli.app import _split, cli, console
from attnbench.errors import UnavailableError


@cli.command("check")
@click.option("--impl", "impls", multiple=True, help="Implementation(s) to check, comma-separated; default all available.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--kind", "kinds", multiple=True, help="Only these case kinds (forward, backward, causality, ...).")
@click.option("--all-cases", is_flag=True, help="Print every case, not just the summary and the failures.")
@click.option("--seed", type=int, default=0, show_default=True, help="Draw other weights and inputs for every case.")
def check_cmd(impls: tuple[str, ...], device: str, kinds: tuple[str, ...], all_cases: bool, seed: int) -> None:
    """Run the correctness matrix; exit 1 if any case fails."""
    from attnbench.correctness.matrix import run_matrix, summarize
    from attnbench.devices import parse_device

    parse_device(device)
    names = _split(impls) or None
    for name in names or []:
        reason = registry.get(name).unavailable_reason(device)  # unknown names fail before anything runs
        if reason:
            raise UnavailableError(f"{name} cannot run on {device} here: {reason}; choose another --device or implementation")
    with console.status("running the correctness matrix ..."):
        results = run_matrix(names, device=device, kinds=_split(kinds) or None, seed=seed)
    summary = summarize(results)
    table = Table(title=f"correctness matrix on {device} (relative max-norm error vs float64 reference)")
    for col in ("impl", "kind", "dtype", "pass", "fail", "error", "skip", "worst error", "tolerance"):
        table.add_column(col, justify="right" if col not in ("impl", "kind", "dtype") else "left")
    for r in summary.itertuples():
        bad = r.failed or r.errors
        table.add_row(r.impl, r.kind, r.dtype, str(r.passed), f"[red]{r.failed}[/]" if r.failed else "0",
                      f"[red]{r.errors}[/]" if r.errors else "0", str(r.skipped),
                      "-" if r.worst_error != r.worst_error else f"{r.worst_error:.2e}",
                      "-" if r.tolerance != r.tolerance else f"{r.tolerance:.0e}", style="bold" if bad else None)
    console.print(table)
    shown = results if all_cases else results[results.status.isin(["fail", "error"])]
    for r in shown.itertuples():
        console.print(f"  {r.status.upper():5} {r.impl} {r.kind} {r.shape} {r.dtype}: {r.message}", markup=False)
    n_bad = int(results.status.isin(["fail", "error"]).sum())
    n_pass = int((results.status == "pass").sum())
    console.print(f"{n_pass} passed, {n_bad} failed, {int((results.status == 'skip').sum())} skipped")
    if n_bad:
        sys.exit(1)
