"""Issue 39's command-line pieces: ``attnbench run --metric instructions`` and the instruction table of
``attnbench compare`` (the counting is :mod:`attnbench.runner.instructions`, the comparison
:mod:`attnbench.results.compare_instructions`). Registers no command of its own."""

from __future__ import annotations

import json
import sys

import click
import pandas as pd
from rich.table import Table

from attnbench.cli.app import console, err_console

METRIC_HELP = ("time (default): time each cell; instructions: count the instructions one call executes under valgrind's "
               "callgrind (CPU cells; one thread, ASLR off, one vector ISA: docs/instructions.md), a figure machine "
               "load cannot move, for a regression gate")
CAPABILITY_HELP = ("--metric instructions: the one vector ISA PyTorch's CPU kernels may use (ATEN_CPU_CAPABILITY, "
                   "oneDNN and MKL limits); default avx2 (valgrind has no AVX-512); export the same in a wall-time "
                   "run paired with the count")


def run_counted(*, preset, sweep_file, settings: dict, axes: dict, out: str, quiet: bool, as_json: bool,
                resume, executor: str, capability: str, timeout_s) -> None:
    """``attnbench run --metric instructions``: count the sweep's cells, print the table, exit 1 when a cell failed."""
    from attnbench.measure.instructions import CountSettings
    from attnbench.runner.engine import argv_for_meta, make_sweep
    from attnbench.runner.instructions import count_sweep

    if resume:
        raise click.UsageError("--metric instructions does not resume a run; count the sweep again (counts repeat)")
    if executor != "local":
        raise click.UsageError("--metric instructions counts on this machine; leave out --executor ray")
    sweep = make_sweep(preset=preset, file=sweep_file, settings=settings, executor=executor, **axes)
    count = CountSettings(capability=capability, **({"timeout_s": float(timeout_s)} if timeout_s else {}))

    def progress(i, total, cell, row):
        if not quiet:
            what = "counting" if row is None else row["status"]
            err_console.print(f"[{i}/{total}] {cell.cell_id}: {what}", markup=False)

    df = count_sweep(sweep, out, count, argv=argv_for_meta(), progress=progress)
    counts = df["status"].value_counts().to_dict()
    if as_json:
        click.echo(json.dumps({"run_id": df.attrs["run_id"], "run_dir": df.attrs["run_dir"], "cells": len(df),
                               "metric": "instructions", "status": {k: int(v) for k, v in counts.items()},
                               "results": f"{df.attrs['run_dir']}/results.parquet"}))
    elif not quiet:
        console.print(instruction_table(df, f"attnbench run {df.attrs['run_id']} (instructions per call)"))
        for r in df[df.status != "ok"].itertuples():
            console.print(f"  {r.status:8} {r.cell_id}: {r.error}", markup=False)
        console.print(f"{len(df)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()), markup=False)
        console.print(f"results: {df.attrs['run_dir']}/results.parquet (no HTML report for counted runs: "
                      "compare two of them with attnbench compare)", markup=False)
    failed = {s: n for s, n in counts.items() if s not in ("ok", "skipped")}
    if failed or not counts.get("ok"):
        from attnbench.cli.closing import first_failed

        first = first_failed(df, tuple(failed))
        said = ", ".join(f"{n} {s}" for s, n in counts.items())
        err_console.print(f"error: {'no cell was counted' if not counts.get('ok') else 'some cells failed'} ({said})"
                          + (f"; first: {first.cell_id}: {first.status}: {first.error}" if first is not None else ""),
                          markup=False)
        sys.exit(1)


def instruction_table(df: pd.DataFrame, title: str) -> Table:
    """The counted cells: instructions per call, the harness baseline, the ISA, how long the count took."""
    from attnbench.results.compare_instructions import fmt_count

    table = Table(title=title)
    for col in ("impl", "device", "dtype", "mode", "b", "T", "h", "d", "instructions", "baseline", "ISA", "count took"):
        table.add_column(col, justify="left" if col in ("impl", "device", "dtype", "mode", "ISA") else "right")
    ok = df[df.status == "ok"].sort_values(["mode", "dtype", "batch", "seq_len", "impl"])
    for r in ok.itertuples():
        table.add_row(r.impl, r.device, r.dtype, r.mode, str(r.batch), str(r.seq_len), str(r.num_heads), str(r.d_model),
                      f"{r.instructions:,.0f}", fmt_count(r.instructions_baseline), str(r.cpu_capability),
                      f"{r.instr_count_s:.0f} s")
    return table


def print_instruction_compare(result, label_a: str, label_b: str) -> None:
    """The instruction layer of ``attnbench compare``: the threshold and how it was set, every compared cell (with
    each run's repeat spread and the cell's threshold), and the top changed functions of each cell that moved."""
    from attnbench.results.compare_instructions import fmt_count

    console.print(f"instruction threshold: {result.describe_threshold()}", markup=False)
    table = Table(title=f"instructions per call, B ({label_b}) vs A ({label_a})")
    for col in ("impl", "cell", "A", "B", "B/A", "B - A", "spread A/B", "fails beyond", "change"):
        table.add_column(col, justify="left" if col in ("impl", "cell", "change") else "right", overflow="fold")
    for r in result.cells.itertuples():
        style = "bold red" if r.regression else "green" if r.improvement else None
        spreads = "/".join(f"{v:.3%}" if v == v else "–" for v in (r.spread_a, r.spread_b))
        table.add_row(r.impl, str(r.cell_id).split("|", 1)[-1], fmt_count(r.instructions_a), fmt_count(r.instructions_b),
                      f"{r.ratio:.5f}x", f"{r.delta:+,.0f}", spreads, f"{r.threshold:.2%} ({r.threshold_source})",
                      r.change, style=style)
    console.print(table)
    for r in result.cells.itertuples():
        if r.ratio != 1 and r.top_functions:
            console.print(f"top changed functions of {r.cell_id} (instructions per call, B - A):", markup=False)
            for name, count_a, delta in r.top_functions:
                console.print(f"  {delta:+14,.0f}  (A {fmt_count(count_a)})  {name[:160]}", markup=False)
        if r.capability_note:
            console.print(f"note: {r.cell_id}: {r.capability_note}: the counts ran different kernels", markup=False)
    for cell_id, sa, sb in result.failed:
        console.print(f"not counted in both runs: {cell_id} (A {sa}, B {sb})", markup=False)
    if result.unmatched:
        console.print(f"{len(result.unmatched)} cell(s) counted in one run only, not compared", markup=False)


def compare_counted(a, b, threshold: float | None = None) -> int | None:
    """``attnbench compare``'s instruction layer when the runs hold counts: print it and return the exit status (1:
    a cell counts more than its threshold more instructions in B; 2: nothing compared). ``threshold``: a fixed one,
    None: each cell's from its recorded repeat spread (:func:`attnbench.results.compare_instructions.cell_threshold`).
    None when neither run holds counts (the timing comparison applies)."""
    from attnbench.results.compare_instructions import compare_instructions, has_instructions
    from attnbench.results.store import load_run

    (dfa, meta_a), (dfb, meta_b) = load_run(a), load_run(b)
    counted = has_instructions(dfa), has_instructions(dfb)
    if not any(counted):
        return None
    label_a, label_b = str(meta_a.get("run_id") or a), str(meta_b.get("run_id") or b)
    if not all(counted):
        which = "A" if not counted[0] else "B"
        err_console.print(f"error: run {which} ({label_b if which == 'B' else label_a}) holds no instruction counts "
                          "while the other does; count both with attnbench run --metric instructions", markup=False)
        return 2
    result = compare_instructions(dfa, dfb, threshold)
    print_instruction_compare(result, label_a, label_b)
    if not len(result.cells):
        err_console.print("error: no cell was counted (ok) in both runs, so nothing was compared", markup=False)
        return 2
    limit = f"{threshold:.2%}" if threshold is not None else "its threshold (set by its counts' noise)"
    if result.has_regression:
        console.print(f"[bold red]FAIL[/]: {len(result.regressions)} cell(s) execute more than {limit} more "
                      "instructions per call in B")
        return 1
    console.print(f"[green]OK[/]: no cell executes more than {limit} more instructions per call in B")
    return 0
