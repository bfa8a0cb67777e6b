"""The ``attnbench`` command line: a thin layer over the Python API.

Errors a user can cause (:class:`~attnbench.errors.AttnbenchError`) print as one line
``error: ...`` and exit with status 2, never with a traceback.
"""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.table import Table

from attnbench import registry
from attnbench.errors import AttnbenchError, UnavailableError

# Wide when piped (logs, CI): rich would otherwise wrap every table at 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _split(values: tuple[str, ...]) -> list[str]:
    """Flatten ``--impl a,b --impl c`` into ``[a, b, c]``."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="attnbench")
def cli() -> None:
    """Correctness, speed and memory of multi-head attention implementations in PyTorch.

    \b
    attnbench list                 implementations and where they run
    attnbench check [--impl NAME]  the correctness matrix against a float64 reference
    attnbench run                  a benchmark sweep (default: a small CPU grid)
    attnbench report RESULTS       plots and an HTML page for a run
    attnbench compare A B          two runs, cell by cell, with significance
    attnbench profile --impl NAME  torch.profiler traces for TensorBoard / Perfetto
    """


@cli.command("list")
@click.option("--device", default="cpu", show_default=True, help="Device whose availability to show (cpu, cuda, cuda:N).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(device: str, as_json: bool) -> None:
    """List every registered implementation with its source, capabilities and availability."""
    from attnbench.devices import parse_device_type

    parse_device_type(device)
    rows = []
    for name in registry.names():
        impl = registry.get(name)
        try:
            reason = impl.unavailable_reason(device)
        except AttnbenchError as exc:
            reason = str(exc)
        rows.append({"name": name, "available": reason is None, "reason": reason or "",
                     "description": impl.description, "source": impl.source, "origin": impl.origin,
                     "devices": list(impl.devices), "dtypes": list(impl.dtypes), "backward": list(impl.backward),
                     "dropout": list(impl.dropout), "min_torch": impl.min_torch,
                     "same_width_only": impl.same_width_only})
    if as_json:
        import json

        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"attnbench implementations (availability on {device})")
    for col in ("name", f"on {device}", "description", "backward", "dropout", "source"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = "[green]yes[/]" if r["available"] else f"[red]no[/]: {r['reason']}"
        table.add_row(r["name"], status, r["description"], ",".join(r["backward"]) or "-",
                      ",".join(r["dropout"]) or "-", r["source"])
    console.print(table)
    console.print("Also: compiled:NAME[@MODE] for any NAME; plug-ins as path/to/file.py:Class or package.module:Class.",
                  markup=False)


@cli.command("check")
@click.option("--impl", "impls", multiple=True, help="Implementation(s) to check, comma-separated; default all available.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--kind", "kinds", multiple=True, help="Only these case kinds (forward, backward, causality, ...).")
@click.option("--all-cases", is_flag=True, help="Print every case, not just the summary and the failures.")
def check_cmd(impls: tuple[str, ...], device: str, kinds: tuple[str, ...], all_cases: bool) -> None:
    """Run the correctness matrix; exit 1 if any case fails."""
    from attnbench.check import run_matrix, summarize
    from attnbench.devices import parse_device

    parse_device(device)
    names = _split(impls) or None
    for name in names or []:
        reason = registry.get(name).unavailable_reason(device)  # unknown names fail before anything runs
        if reason:
            raise UnavailableError(f"{name} cannot run on {device} here: {reason}; choose another --device or implementation")
    with console.status("running the correctness matrix ..."):
        results = run_matrix(names, device=device, kinds=_split(kinds) or None)
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


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors become one line and exit status 2."""
    try:
        cli.main(args=argv, prog_name="attnbench", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AttnbenchError as exc:
        err_console.print(f"error: {exc}", markup=False)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


# Sub-commands that live in their own modules register themselves on import.
for _module in ("attnbench.cli_run", "attnbench.cli_report", "attnbench.cli_profile", "attnbench.cli_asv"):
    try:
        __import__(_module)
    except ModuleNotFoundError as _exc:
        if _exc.name != _module:
            raise
