"""``attnbench adapt FILE:Class``: write an adapter for a class attnbench cannot bind by itself (plugins.adapt)."""

from __future__ import annotations

from pathlib import Path

import click

from attnbench.cli.app import cli, console
from attnbench.errors import AttnbenchError


@cli.command("adapt")
@click.argument("target", metavar="FILE.py:Class")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the adapter. Default: <class>_adapter.py in the current directory.")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def adapt_cmd(target: str, out: Path | None, force: bool) -> None:
    """Write a small adapter for FILE.py:Class: the class built from a spec with every argument attnbench solved, and
    a TODO for each it could not. Complete the TODOs, then `attnbench check ADAPTER.py:Adapted`.

    Exit status: 0 written, 2 the class does not import or the file exists (without --force)."""
    from attnbench import registry
    from attnbench.errors import PluginLoadError
    from attnbench.plugins import import_file
    from attnbench.plugins.adapt import write_adapter
    from attnbench.spec import AttnSpec

    path_text, _, cls_name = target.rpartition(":")
    if not path_text.endswith(".py") or not cls_name:
        raise click.BadParameter("is not FILE.py:Class", param_hint="TARGET")
    cls = getattr(import_file(path_text), cls_name, None)  # a file that does not import: one line, exit 2
    if cls is None:
        raise PluginLoadError(f"{path_text} has no {cls_name!r}")
    out = out or Path(f"{cls_name.lower()}_adapter.py")
    if out.exists() and not force:
        raise PluginLoadError(f"{out} exists; pass --force to overwrite it, or -o to write elsewhere")
    try:  # built as check's refusals build it: a class that registers but cannot be built does not bind by itself
        registry.get(target).factory(AttnSpec(64, 64, 16, 0.0, 4))
        why = "attnbench binds this class by itself; this adapter writes out what it solved, for you to change."
    except Exception as exc:  # the refusal (construction failures come as one, from stages.raising_factory)
        text = str(exc) if isinstance(exc, AttnbenchError) else f"{type(exc).__name__}: {exc}"
        why = "attnbench refused the class as it is:\n    " + (text.splitlines() or [""])[0][:600]
    write_adapter(path_text, cls_name, cls, out, why)
    todos = out.read_text().count("TODO(") - 1  # the helper's own definition
    console.print(f"wrote {out}: {todos} TODO(s) to complete; then `attnbench check {out}:Adapted`")

