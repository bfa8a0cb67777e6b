"""``attnbench check``: the correctness matrix against the float64 reference."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from attnbench import registry
from attnbench.cli.app import _split, cli, console
from attnbench.errors import UnavailableError


@cli.command("check")
@click.argument("impl_args", nargs=-1, metavar="[IMPL]...")
@click.option("--impl", "impls", multiple=True,
              help="Implementation(s) to check, comma-separated (NAME, file.py:Class, SHORT=file.py:Class); default all available.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--kind", "kinds", multiple=True, help="Only these case kinds (forward, backward, causality, ...).")
@click.option("--all-cases", is_flag=True, help="Print every case, not just the summary and the failures.")
@click.option("-v", "--verbose", is_flag=True, help="Print how each plug-in is constructed and where its weights map.")
@click.option("--seed", type=int, default=0, show_default=True, help="Draw other weights and inputs for every case.")
@click.option("--scope", type=click.Choice(["layer", "block", "model"]), default="layer", show_default=True,
              help="block / model: the implementation inside a tiny transformer block or GPT against the float64 "
              "reference block or model, and (model) generation with == without the KV cache == the reference.")
def check_cmd(impl_args: tuple[str, ...], impls: tuple[str, ...], device: str, kinds: tuple[str, ...], all_cases: bool,
              verbose: bool, seed: int, scope: str) -> None:
    """Run the correctness matrix on IMPL (or --impl) and print one summary line per implementation.

    Exit status: 0 every case passed, 1 some case failed, 2 a setup or usage error (an implementation
    that does not import, construct or map its weights is reported once, before any case runs).
    """
    from attnbench.correctness.matrix import SHAPES, run_matrix, summarize
    from attnbench.devices import parse_device
    from attnbench.plugins import preflight

    parse_device(device)
    names = _split(impl_args + impls) or None
    for name in names or []:
        reason = registry.get(name).unavailable_reason(device)  # unknown names fail before anything runs
        if reason:
            raise UnavailableError(f"{name} cannot run on {device} here: {reason}; choose another --device or implementation")
    for name in names or []:  # construct and map weights once: a setup error is one line, not one per case
        impl = registry.get(name)
        lines = preflight(impl, device, other_specs=[shape.spec for shape in SHAPES])
        if verbose and lines:
            console.print(f"{impl.name}:", markup=False)
            for line in lines:
                console.print(f"  {line}", markup=False)
    with console.status("running the correctness matrix ..."):
        if scope == "layer":
            results = run_matrix(names, device=device, kinds=_split(kinds) or None, seed=seed)
        else:
            from attnbench.models.check import run_scope_checks

            results = run_scope_checks(names, scope, device=device, seed=seed)
    summary = summarize(results)
    where = "" if scope == "layer" else f" at {scope} scope"
    table = Table(title=f"correctness matrix{where} on {device} (relative max-norm error vs float64 reference)")
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
    for impl_name, rows in results.groupby("impl", sort=False):
        console.print(_summary_line(impl_name, rows), markup=False)
    if n_bad:
        sys.exit(1)


def _summary_line(impl_name: str, rows) -> str:
    """``NAME: PASS (40 passed, 4 skipped)`` or ``NAME: FAIL (3 failed: forward, causality; 38 passed)``."""
    bad = rows[rows.status.isin(["fail", "error"])]
    counts = f"{int((rows.status == 'pass').sum())} passed, {int((rows.status == 'skip').sum())} skipped"
    if bad.empty:
        return f"{impl_name}: PASS ({counts})"
    return f"{impl_name}: FAIL ({len(bad)} failed: {', '.join(dict.fromkeys(bad.kind))}; {counts})"
