"""``attnbench list``: every registered implementation and where it runs."""

from __future__ import annotations

import textwrap

import click
from rich import box
from rich.table import Table

from attnbench import registry
from attnbench.cli.app import cli, console
from attnbench.errors import AttnbenchError

VARIANT_SHORT = {"gqa": "gqa", "sliding_window": "window", "non_causal": "bidir", "kv_cache": "kv", "masks": "masks"}
"""The compact table's names of the variants (``--wide`` and ``--json``: the fields' own)."""
COMPACT_WIDTH = 100
"""The compact table fits this many columns (or the terminal, when narrower)."""


@cli.command("list")
@click.option("--device", default="cpu", show_default=True, help="Device whose availability to show (cpu, cuda, cuda:N).")
@click.option("--wide", is_flag=True, help="Every column (description, dropout, source) in full, wrapped.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(device: str, wide: bool, as_json: bool) -> None:
    """List every registered implementation and whether it runs here: one line each (--wide: source and capabilities
    in full)."""
    from attnbench.devices import parse_device_type

    parse_device_type(device)
    rows = []
    for name in registry.listed():
        impl = registry.get(name)
        try:
            reason = impl.unavailable_reason(device)
        except AttnbenchError as exc:
            reason = str(exc)
        rows.append({"name": name, "available": reason is None, "reason": reason or "",
                     "description": impl.description, "source": impl.source, "origin": impl.origin,
                     "devices": list(impl.devices), "dtypes": list(impl.dtypes), "backward": list(impl.backward),
                     "dropout": list(impl.dropout), "min_torch": impl.min_torch,
                     "same_width_only": impl.same_width_only,
                     "variants": [v for v in ("gqa", "sliding_window", "non_causal", "kv_cache", "masks")
                                  if getattr(impl, v, None)]})
    if as_json:
        import json

        click.echo(json.dumps(rows, indent=2))
        return
    console.print(_wide_table(rows, device) if wide else _compact_table(rows, device))
    also = ("Also: compiled:NAME[@MODE] for any NAME; hf:package.module:Class[@BACKEND] for any transformers attention "
            "class; plug-ins as path/to/file.py:Class or package.module:Class.")
    width = console.width if wide else min(console.width, COMPACT_WIDTH)
    console.print("\n".join(textwrap.wrap(also, width)), markup=False, soft_wrap=True)


def _wide_table(rows: list[dict], device: str) -> Table:
    table = Table(title=f"attnbench implementations (availability on {device})")
    for col in ("name", f"on {device}", "description", "backward", "dropout", "variants", "source"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = "[green]yes[/]" if r["available"] else f"[red]no[/]: {r['reason']}"
        table.add_row(r["name"], status, r["description"], ",".join(r["backward"]) or "-",
                      ",".join(r["dropout"]) or "-", ",".join(r["variants"]) or "-", r["source"])
    return table


def _compact_table(rows: list[dict], device: str) -> Table:
    """One line per implementation: its whole name, whether it runs here (why not, when there is room), backward
    (when there is room), variants, and as much of the description as fits; ``--wide`` has the rest."""
    width = min(console.width, COMPACT_WIDTH)
    roomy = width >= COMPACT_WIDTH
    table = Table(title=f"attnbench implementations on {device} (--wide: sources and details)",
                  width=width, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column(f"on {device}", no_wrap=True)
    if roomy:
        table.add_column("backward", no_wrap=True)
    table.add_column("variants", no_wrap=True)
    table.add_column("description", no_wrap=True, overflow="ellipsis", ratio=1)
    for r in rows:
        status = "[green]yes[/]" if r["available"] else (
            f"[red]no[/] ({r['reason']})" if roomy and len(r["reason"]) <= 16 else "[red]no[/]")
        table.add_row(r["name"], status, *([",".join(r["backward"]) or "-"] if roomy else []),
                      ",".join(VARIANT_SHORT[v] for v in r["variants"]) or "-", r["description"])
    return table
