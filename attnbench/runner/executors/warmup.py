"""The warm-up every measuring process does, whoever started it (a local worker or a Ray worker).

Costs paid once per process are paid here, before a cell's clock (``cell_timeout_s``) starts and outside any
timed region: torch's threads created and placed, the modules :func:`~attnbench.runner.cell.run_cell` imports
on its first call, the profiler (peak memory) imported, and per cell the implementation's import, Dynamo's
counters for compiled cells and the machine's peak GFLOP/s.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable

from attnbench.measure import cpu_env
from attnbench.results.schema import Cell


def warm_process(threads: int | None, pinned: bool) -> None:
    """Prepare this process to measure: glibc's malloc pinned (``pinned``), ``threads`` intra-op threads (when
    given) created and placed by one parallel region, and the first-use imports done."""
    if pinned:
        cpu_env.pin_glibc_malloc()  # before any cell allocates (the environment did it at exec already)
    import torch

    import attnbench.runner.cell  # noqa: F401  (what run_cell imports on its first call)
    import attnbench.runner.workload  # noqa: F401
    from attnbench.measure import peak_memory

    if threads:
        torch.set_num_threads(threads)
    a = torch.randn(256, 256)
    (a @ a).sum().item()  # one parallel region: the OpenMP threads exist and are placed before describe()
    # The profiler (peak memory) imports seconds of modules on first use: here, not inside the first cell's clock.
    peak_memory(lambda: a @ a, torch.device("cpu"))


def settle_heap() -> None:
    """Collect the garbage, then leave every object alive now out of later collections (``gc.freeze``).

    A measuring process holds torch's, Inductor's and the implementations' modules: half a million objects, which
    every full collection walks (a quarter of a second, in :func:`~attnbench.runner.cell.release` after each group
    and whenever the collector runs on its own). Frozen, they are no longer walked; objects freed by their reference
    count still are freed, and what a later group leaves behind is collected as before. For a process that only
    measures (called after its warm-up and after each unit of work), never for a user's own process."""
    gc.collect()
    gc.freeze()


def warm_cells(cells: Iterable[Cell], peak_known: bool = False) -> None:
    """Once-per-process costs of ``cells``: each implementation's import, Dynamo's counters for ``compiled:``
    cells, (unless ``peak_known``) the peak GFLOP/s of each device and dtype (cached) and the roofline's ceilings
    (:func:`attnbench.measure.roofline.ceiling_for`: cached per machine). A failure here is
    left for the cell to report as its row."""
    from attnbench import registry
    from attnbench.measure import peak_gflops, roofline

    for cell in cells:
        with contextlib.suppress(Exception):
            registry.get(cell.impl)
            if cell.impl.startswith("compiled:"):
                import torch._dynamo.utils  # noqa: F401  (run_cell counts compiled graphs: seconds to import)
            ceiling = roofline.ceiling_for(cell.device, cell.dtype)  # issue 49: cached per machine, measured once
            if not peak_known:  # with the ceiling known, the peak is a quick check against it
                peak_gflops(cell.device, cell.dtype, floor=ceiling.gflops_per_s)
