"""``attnbench check``: the correctness matrix against the float64 reference."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import click
from rich.table import Table

from attnbench.cli.app import _split, cli, console
from attnbench.cli.grouped import grouped

CHECK_SECTIONS = (
    ("What to check", ("impls", "device", "scope", "kinds", "shapes", "dtypes", "seed")),
    ("Output", ("all_cases", "verbose", "json_path")),
    ("Execution", ("case_timeout",)),
)
"""``attnbench check --help``'s sections, common options first."""


@cli.command("check", cls=grouped(CHECK_SECTIONS))
@click.argument("impl_args", nargs=-1, metavar="[IMPL]...")
@click.option("--impl", "impls", multiple=True,
              help="Implementation(s) to check, comma-separated (NAME, file.py:Class, SHORT=file.py:Class, hf:NAME). "
                   "Default: every registered implementation available here; hf: names (Hugging Face layers, "
                   "listed by `attnbench list`) are checked only when named.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--kind", "kinds", multiple=True, help="Only these case kinds (forward, backward, causality, ...).")
@click.option("--shape", "shapes", multiple=True, help="Only the cases of these shape ids (gpt_like, gqa, ...; as a "
              "failing case's rerun line names them).")
@click.option("--dtype", "dtypes", multiple=True, help="Only the cases in these dtypes (float64, float32, float16, bfloat16).")
@click.option("--all-cases", is_flag=True, help="Print every case, not just the summary and the failures.")
@click.option("-v", "--verbose", is_flag=True, help="Print how each plug-in is constructed and where its weights map.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write every case and the measured properties (deterministic, batch_invariant, ...: "
              "docs/correctness.md, Properties) to this JSON file.")
@click.option("--seed", type=int, default=0, show_default=True, help="Draw other weights and inputs for every case.")
@click.option("--case-timeout", "--timeout", "case_timeout", metavar="SECONDS|none",
              help="Seconds after which a case fails as a timeout (and its implementation's later cases are skipped). "
              "Default 60 (300 for compiled:); none: no timeout. It also bounds each implementation's setup (import, "
              "construction, the probes that read it; at least 10 s, default 120 s), stopped as one line naming where "
              "it hung.")
@click.option("--scope", type=click.Choice(["layer", "block", "model"]), default="layer", show_default=True,
              help="block / model: the implementation inside a tiny transformer block or GPT against the float64 "
              "reference block or model, and (model) generation with == without the KV cache == the reference.")
def check_cmd(impl_args: tuple[str, ...], impls: tuple[str, ...], device: str, kinds: tuple[str, ...], all_cases: bool,
              verbose: bool, seed: int, case_timeout: str | None, scope: str, json_path: str | None = None,
              shapes: tuple[str, ...] = (), dtypes: tuple[str, ...] = ()) -> None:
    """Run the correctness matrix on IMPL (or --impl) and print one summary line per implementation.

    With no IMPL: every registered implementation available here (hf: names only when named).

    Exit status: 0 every case passed, 1 some case failed, 2 a setup or usage error (an implementation
    that does not import, construct or map its weights is reported once, before any case runs). Each failing case
    prints the command that reruns it alone, and once per failing kind where it first leaves the reference.
    """
    from attnbench.correctness.matrix import run_matrix
    from attnbench.devices import parse_device
    from attnbench.runner.budget import parse_timeout

    timeout = "auto" if case_timeout is None else parse_timeout(case_timeout, "--case-timeout")  # 0: one line, exit 2
    parse_device(device)
    names = _split(impl_args + impls) or None
    if (impl_args or impls) and not names:
        raise click.BadParameter("is empty; name implementations (attnbench list), or leave it out to check every "
                                 "available one", param_hint="--impl")
    for name in names or []:
        _file_without_class(name)
    resolved = _set_up(names or [], device, timeout, verbose)
    only = _case_filter(_split(shapes), _split(dtypes))
    with console.status("running the correctness matrix ..."):
        if scope == "layer":
            results = run_matrix(names, device=device, kinds=_split(kinds) or None, seed=seed, case_timeout_s=timeout,
                                 only=only)
        else:
            from attnbench.models.check import run_scope_checks

            results = run_scope_checks(names, scope, device=device, seed=seed)
    console.print(matrix_table(results, device, scope))
    spelled = {impl.name: name for impl, name in zip(resolved, names or [], strict=False)}
    found = _print_cases(results, all_cases, seed, device, spelled if scope == "layer" else None)
    n_bad = int(results.status.isin(["fail", "error"]).sum())
    n_pass = int((results.status == "pass").sum())
    console.print(f"{n_pass} passed, {n_bad} failed, {int((results.status == 'skip').sum())} skipped")
    for impl_name, rows in results.groupby("impl", sort=False):
        console.print(summary_line(impl_name, rows), markup=False)
        for line in _about(impl_name, rows, scope):
            console.print(f"  {line}", markup=False)
    if verbose:
        _print_exercised(results)
        _print_properties(results)
    if json_path:
        _write_json(results, json_path, found)
    if n_bad:
        sys.exit(1)


def _set_up(names: list[str], device: str, timeout, verbose: bool) -> list:
    """Resolve each implementation, build it and map its weights once, each within the setup bound (a setup error,
    or a hang, is one line before any case runs); print what ``-v`` shows (a ``kv order:`` finding always)."""
    from attnbench.correctness.setup import available, bounded, prepared, setup_seconds

    bound = setup_seconds(timeout)
    resolved = []
    for name in names:  # unknown names fail before anything runs
        with bounded(name, bound):
            resolved.append(available(name, device))
    for impl in resolved:
        with bounded(impl.name, bound):
            lines = prepared(impl, device)
        lines = lines if verbose else [line for line in lines if line.startswith("kv order:")]
        if lines:
            console.print(f"{impl.name}:", markup=False)
            for line in lines:
                console.print(f"  {line}", markup=False)
    return resolved


def _file_without_class(name: str) -> None:
    """``check my_attn.py`` names a file, not a class: a :class:`UnknownImplementationError` naming the file's
    ``nn.Module`` classes and, when one of them is plainly the attention class (the only class, or the only one whose
    name says attention), the command that checks it. Any other name passes through untouched."""
    import inspect

    from torch import nn

    from attnbench.errors import UnknownImplementationError
    from attnbench.plugins import import_file, split_display_name

    display, target = split_display_name(name)
    if not target.endswith(".py") or ":" in target:
        return
    if not Path(target).expanduser().is_file():
        raise UnknownImplementationError(f"{target}: no such file (a plug-in is given as path/to/file.py:Class)")
    module = import_file(target)  # a file that does not import: a PluginLoadError, one line
    classes = [n for n, v in vars(module).items()
               if inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == module.__name__]
    if not classes:
        raise UnknownImplementationError(f"{target} names a file, not a class, and it defines no nn.Module class; "
                                         "a plug-in is given as path/to/file.py:Class")
    named = [c for c in classes if "att" in c.lower()]
    pick = classes[0] if len(classes) == 1 else named[0] if len(named) == 1 else None
    prefix = f"{display}=" if display else ""
    how = (f"check {pick} with `attnbench check {prefix}{target}:{pick}`" if pick else
           f"name one as FILE.py:Class, e.g. `attnbench check {prefix}{target}:{classes[0]}`")
    raise UnknownImplementationError(f"{target} names a file, not a class; its nn.Module classes: "
                                     f"{', '.join(classes)}; {how}")


def summary_line(impl_name: str, rows) -> str:
    """``NAME: PASS (40 passed, 4 skipped)`` or ``NAME: FAIL (3 failed: forward, causality; 38 passed)``."""
    bad = rows[rows.status.isin(["fail", "error"])]
    counts = f"{int((rows.status == 'pass').sum())} passed, {int((rows.status == 'skip').sum())} skipped"
    if bad.empty:
        return f"{impl_name}: PASS ({counts})"
    return f"{impl_name}: FAIL ({len(bad)} failed: {', '.join(dict.fromkeys(bad.kind))}; {counts})"


def _about(impl_name: str, rows, scope: str = "layer") -> list[str]:
    """The lines under an implementation's summary: its working precision, its coverage, and likely causes."""
    from attnbench.correctness.cases import working_summary

    lines = [working_summary(impl_name)] if scope == "layer" else []
    lines.append(coverage_line(rows))
    lines += likely_causes(rows)
    return [line for line in lines if line]


def likely_causes(rows) -> list[str]:
    """``likely cause (18 failed cases): scores scaled by 1/sqrt(d_out), expected 1/sqrt(head_dim)``: each verified
    cause once (:mod:`attnbench.correctness.diagnose`), with how many failed cases it explains."""
    causes = [m.split("likely cause: ", 1)[1] for m in rows.message if "likely cause: " in m]
    keys = [c.split(" (here", 1)[0].split("; the output", 1)[0] for c in causes]
    return [f"likely cause ({n} failed case{'s' * (n != 1)}): {k}; the output matches the reference computed that "
            "way (attnbench checked)" for k, n in Counter(keys).items()]


def coverage_line(rows) -> str:
    """``ran 78 of the 82 cases this class can take (4 skipped: odd head dim)``: the cases a class's own
    constraints or the machine rule out count; those needing a variant it does not have do not."""
    from attnbench.plugins.layout import OWN_CONSTRAINT

    ran = rows[rows.status != "skip"]
    skipped = rows[rows.status == "skip"]
    own = skipped[skipped.message.str.contains(OWN_CONSTRAINT, regex=False)]
    why = own.message.map(lambda m: "odd head dim" if "needs an even head dim" in m else
                          "an encoder's attention: every case ran non-causal" if "an encoder's attention" in m else
                          "its own constraint")
    counts = ", ".join(f"{n} {w}" if len(why.unique()) > 1 else w for w, n in why.value_counts().items())
    other = len(skipped) - len(own)
    tail = f"; {other} more are for variants, devices or dtypes it does not have" if other else ""
    return (f"ran {len(ran)} of the {len(ran) + len(own)} cases this class can take"
            f"{f' ({len(own)} skipped: {counts})' if len(own) else ''}{tail}")


def matrix_table(results, device: str, scope: str = "layer") -> Table:
    """The check's summary: one row per implementation, kind and dtype (the console's, and a notebook's)."""
    from attnbench.correctness.matrix import summarize

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
    return table


def _print_properties(results) -> None:
    """``NAME properties (1 thread, torch 2.x): deterministic float32 bitwise; ...`` (issue 48)."""
    from attnbench.correctness.invariance import summary_lines

    for line in summary_lines(results):
        console.print(line, markup=False)


def _write_json(results, path: str, found: dict | None = None) -> None:
    """``{"cases": [...], "properties": [...]}`` to ``path``: every case's row and each measured
    property as fields (:func:`attnbench.correctness.invariance.properties`); a failing case also has ``rerun`` (the
    command that reruns it alone) and, the one localised for its kind, ``localization`` (``found``: row -> fields,
    :func:`_print_cases`). The schema: ``attnbench/correctness/check.schema.json`` (docs/localize.md)."""
    import json

    from attnbench.correctness.invariance import properties

    cases = results.astype(object).where(results.notna(), None).to_dict(orient="records")
    for i, extra in (found or {}).items():
        cases[i].update(extra)
    text = json.dumps({"cases": cases, "properties": properties(results)}, indent=1)
    Path(path).write_text(text + "\n")


def _case_filter(shapes: list[str], dtypes: list[str]):
    """``check --shape/--dtype``: a predicate on cases (``None``: every case); an unknown shape id or dtype is a
    usage error naming the known ones."""
    from attnbench.correctness.cases import TOLERANCE
    from attnbench.correctness.matrix import shape_specs

    for given, known, hint in ((shapes, list(shape_specs()), "--shape"), (dtypes, list(TOLERANCE), "--dtype")):
        unknown = [v for v in given if v not in known]
        if unknown:
            raise click.BadParameter(f"unknown {unknown}; use {', '.join(known)}", param_hint=hint)
    if not shapes and not dtypes:
        return None
    return lambda case: (not shapes or case.shape.id in shapes) and (not dtypes or case.dtype in dtypes)


def _print_cases(results, all_cases: bool, seed: int, device: str, spelled: dict | None) -> dict[int, dict]:
    """Each failing case's line (every case's with ``--all-cases``), under it the command that reruns it alone, and
    once per implementation and failing kind where the class first leaves the reference
    (:mod:`attnbench.correctness.localize`); returns row -> the JSON fields said (``rerun``, ``localization``).
    ``spelled``: implementation name -> as given on the command line (``None``: no localisation, block/model scope)."""
    from attnbench.correctness.localize import localize_failures
    from attnbench.correctness.matrix import case_line

    found = localize_failures(results, seed, device, spelled) if spelled is not None else {}
    shown = results if all_cases else results[results.status.isin(["fail", "error"])]
    for i, r in zip(shown.index, shown.itertuples(), strict=True):
        console.print(f"  {case_line(r)}", markup=False)
        extra = found.get(i, {})
        if "localization" in extra:
            console.print(f"    {extra['localization']['line']}", markup=False, soft_wrap=True)  # one line: parsed
        if "rerun" in extra:
            console.print(f"    rerun: {extra['rerun']}", markup=False, soft_wrap=True)
    return found


def _print_exercised(results) -> None:
    """``NAME exercised: RoPE (...), QK-norm (head), score scale, softcap``: the positional fields its cases ran."""
    from attnbench.correctness.matrix import shape_specs
    from attnbench.correctness.positional import exercised

    for impl_name, text in exercised(results, shape_specs()).items():
        console.print(f"{impl_name} exercised: {text}", markup=False)
