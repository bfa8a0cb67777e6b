"""``attnbench profile``: torch.profiler traces per implementation, viewable in TensorBoard and Perfetto."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
import torch
from rich.table import Table

from attnbench.cli.app import _split, cli, console
from attnbench.devices import dtype_name
from attnbench.errors import SweepError
from attnbench.registry import resolve
from attnbench.resolve import Skip
from attnbench.results.schema import MODES, Cell
from attnbench.results.text import fmt_bytes, fmt_time

TB_PORT = 6006


def _validate(cells: list[Cell]) -> torch.device:
    """Fail on bad input (one line, via AttnbenchError) before any profiling starts or any file is written;
    return the device the cells run on."""
    for cell in cells:
        outcome = resolve(cell.impl, cell)  # the variant rule too: e.g. decode without a KV cache
        if isinstance(outcome, Skip):
            raise outcome.exception()
    return outcome.device


@cli.command("profile")
@click.option("--impl", "impls", multiple=True, required=True,
              help="Implementation(s) to profile, comma-separated or repeated (see `attnbench list`).")
@click.option("--batch", default=2, show_default=True, type=click.IntRange(min=1), help="Batch size.")
@click.option("--seq", "seq_len", default=128, show_default=True, type=click.IntRange(min=1), help="Sequence length T.")
@click.option("--heads", "num_heads", default=4, show_default=True, type=click.IntRange(min=1), help="Number of heads.")
@click.option("--d-model", "d_model", default=256, show_default=True, type=click.IntRange(min=1),
              help="Model width (d_in = d_out).")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16, float16, float64.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--mode", default="forward", show_default=True, type=click.Choice(MODES), help="What one step runs.")
@click.option("--logdir", default="runs", show_default=True, type=click.Path(file_okay=False),
              help="TensorBoard log folder; each implementation/configuration is one run (sub-folder) in it.")
@click.option("--top", default=15, show_default=True, type=click.IntRange(min=0),
              help="Operators shown per implementation.")
def profile_cmd(impls: tuple[str, ...], batch: int, seq_len: int, num_heads: int, d_model: int, dtype: str,
                device: str, mode: str, logdir: str, top: int) -> None:
    """Profile implementations with torch.profiler: top operators here, full traces for TensorBoard / Perfetto.

    Records 3 steps (after 1 skipped and 2 warm-up steps) with shapes, memory and Python stacks; writes
    <logdir>/<impl>-<device>-<dtype>-b<B>-T<T>-h<H>-d<D>-<mode>/*.pt.trace.json.
    """
    from attnbench.profiling import profile_cell

    names = _split(impls)
    if not names:
        raise SweepError("--impl is empty; name at least one implementation (`attnbench list` shows them)")
    cells = [Cell(impl=n, device=device, dtype=dtype_name(dtype), batch=batch, seq_len=seq_len,
                  num_heads=num_heads, d_model=d_model, mode=mode) for n in names]
    on_device = _validate(cells).type == "cuda"
    results = []
    for cell in cells:
        with console.status(f"profiling {cell.impl} ..."):
            res = profile_cell(cell, logdir=logdir)
        results.append(res)
        table = Table(title=f"{cell.impl}: top {min(top, len(res.ops))} of {len(res.ops)} operators by self "
                            f"{'device' if on_device else 'CPU'} time, totals over {res.active_steps} steps "
                            f"(run {res.run_name})")
        table.add_column("operator", overflow="fold")
        table.add_column("calls", justify="right")
        table.add_column("self CPU", justify="right")
        table.add_column("CPU total", justify="right")
        if on_device:
            table.add_column("self device", justify="right")
            table.add_column("device total", justify="right")
        table.add_column("self CPU mem", justify="right")
        table.add_column("CPU mem", justify="right")
        for r in res.top(top).itertuples():
            cells_ = [r.op, str(r.calls), fmt_time(r.self_cpu_s), fmt_time(r.cpu_total_s)]
            if on_device:
                cells_ += [fmt_time(r.self_device_s), fmt_time(r.device_total_s)]
            cells_ += [fmt_bytes(r.self_cpu_memory_bytes), fmt_bytes(r.cpu_memory_bytes)]
            table.add_row(*cells_)
        console.print(table)
        for f in res.trace_files:
            console.print(f"trace: {f}", markup=False, soft_wrap=True)
    root = Path(results[0].logdir)
    console.print()
    console.print(f"{len(results)} run(s) in {root}. View them in TensorBoard (PyTorch Profiler tab):",
                  markup=False, soft_wrap=True)
    console.print(f"  tensorboard --logdir {shlex.quote(str(root))} --host 127.0.0.1 --port {TB_PORT}",
                  markup=False, soft_wrap=True)
    console.print(f"  then open http://127.0.0.1:{TB_PORT}/#pytorch_profiler", markup=False, soft_wrap=True)
    console.print("or open a *.pt.trace.json file in https://ui.perfetto.dev (or chrome://tracing).",
                  markup=False, soft_wrap=True)
