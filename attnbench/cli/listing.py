"""``attnbench list``: every registered implementation and where it runs."""

from __future__ import annotations

import click
from rich.table import Table

from attnbench import registry
from attnbench.cli.app import cli, console
from attnbench.errors import AttnbenchError


@cli.command("list")
@click.option("--device", default="cpu", show_default=True, help="Device whose availability to show (cpu, cuda, cuda:N).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(device: str, as_json: bool) -> None:
    """List every registered implementation with its source, capabilities and availability."""
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
                     "variants": [v for v in ("gqa", "sliding_window", "non_causal", "kv_cache") if getattr(impl, v)]})
    if as_json:
        import json

        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"attnbench implementations (availability on {device})")
    for col in ("name", f"on {device}", "description", "backward", "dropout", "variants", "source"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = "[green]yes[/]" if r["available"] else f"[red]no[/]: {r['reason']}"
        table.add_row(r["name"], status, r["description"], ",".join(r["backward"]) or "-",
                      ",".join(r["dropout"]) or "-", ",".join(r["variants"]) or "-", r["source"])
    console.print(table)
    console.print("Also: compiled:NAME[@MODE] for any NAME; hf:package.module:Class[@BACKEND] for any transformers attention "
                  "class; plug-ins as path/to/file.py:Class or package.module:Class.",
                  markup=False)
