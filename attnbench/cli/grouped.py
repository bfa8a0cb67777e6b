"""Commands whose ``--help`` lists the options in sections (what to run, the grid, measurement, ...), common first.

Click lists a command's options in one flat block; :func:`grouped` gives a command class that writes one block per
section instead, in the order given, and the options no section names (``--help``) last under "Other".
"""

from __future__ import annotations

import click

Sections = tuple[tuple[str, tuple[str, ...]], ...]


class GroupedCommand(click.Command):
    """A :class:`click.Command` whose options' help is written section by section (:attr:`sections`)."""

    sections: Sections = ()

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        unknown = [n for _, names in self.sections for n in names if n not in records]
        if unknown:  # a renamed option: fail loudly here (and in the tests), not silently drop it from the help
            raise RuntimeError(f"help sections of {self.name!r} name options it does not have: {unknown}")
        placed = set()
        for title, names in self.sections:
            rows = [records[n] for n in names if records[n]]
            placed.update(names)
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        rest = [record for name, record in records.items() if record and name not in placed]
        if rest:
            with formatter.section("Other"):
                formatter.write_dl(rest)


def grouped(sections: Sections) -> type[GroupedCommand]:
    """A :class:`GroupedCommand` class for ``@cli.command(..., cls=grouped(SECTIONS))``."""
    return type("GroupedCommand", (GroupedCommand,), {"sections": sections})


def ungrouped(command: click.Command) -> list[str]:
    """Names of the command's options that no help section lists, other than ``help`` (the tests: none)."""
    placed = {n for _, names in getattr(command, "sections", ()) for n in names}
    return [p.name for p in command.params if isinstance(p, click.Option) and p.name not in placed and p.name != "help"]
