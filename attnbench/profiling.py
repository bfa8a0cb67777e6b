"""``torch.profiler`` traces of one cell, for TensorBoard (torch-tb-profiler) and Perfetto.

:func:`profile_cell` runs a cell's :class:`~attnbench.runner.workload.Workload` under
``torch.profiler.profile`` with a ``wait / warmup / active`` schedule and writes one Chrome-trace
JSON file (``*.pt.trace.json``) per call into ``<logdir>/<run_name>/`` through
``torch.profiler.tensorboard_trace_handler``. Every implementation and configuration gets its own
run folder, which is what TensorBoard's PyTorch Profiler tab calls a *run*; the same files open
in https://ui.perfetto.dev or ``chrome://tracing``.

It also returns the operator table (``prof.key_averages()`` of the active window) that
:func:`save_ops` writes as Parquet for the HTML report::

    impl, cell_id, op, calls, self_cpu_s, cpu_total_s, self_device_s, device_total_s,
    self_cpu_memory_bytes, cpu_memory_bytes

One row per host-side operator. Times are seconds summed over the ``active`` steps (divide by
``active`` for per-step figures); ``self_device_s`` is the time of the GPU kernels the operator
launched itself (``device_total_s`` with its children's), 0.0 on CPU-only cells. Memory is bytes
allocated minus freed on the host over those steps (``self_...``: by the op itself, not its
children), so it can be negative.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from attnbench.devices import synchronize
from attnbench.errors import ResultsError, SweepError
from attnbench.measure.memory import native_stderr
from attnbench.results.schema import Cell
from attnbench.runner.workload import build_workload

OPS_COLUMNS: dict[str, str] = {
    "impl": "string",
    "cell_id": "string",
    "op": "string",
    "calls": "int64",
    "self_cpu_s": "float64",
    "cpu_total_s": "float64",
    "self_device_s": "float64",
    "device_total_s": "float64",
    "self_cpu_memory_bytes": "int64",
    "cpu_memory_bytes": "int64",
}
"""Column name -> pandas dtype of the operator table (``ops.parquet``), in this order."""

TRACE_SUFFIX = ".pt.trace.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 120


@dataclass(frozen=True)
class ProfileResult:
    """What :func:`profile_cell` wrote and measured."""

    cell: Cell
    logdir: Path  # what to pass to ``tensorboard --logdir``
    run_dir: Path  # ``logdir / run_name``: one TensorBoard run
    trace_files: tuple[Path, ...]  # the ``*.pt.trace.json`` written by this call (Chrome trace / Perfetto)
    ops: pd.DataFrame = field(compare=False, hash=False, repr=False)  # columns OPS_COLUMNS, by self time
    active_steps: int = 3

    @property
    def run_name(self) -> str:
        """The run's name in TensorBoard (its folder relative to ``logdir``)."""
        return self.run_dir.relative_to(self.logdir).as_posix()

    @property
    def trace_file(self) -> Path:
        """The (last) trace file written."""
        return self.trace_files[-1]

    def top(self, n: int = 15) -> pd.DataFrame:
        """The ``n`` operators with the most self time."""
        return self.ops.head(n)


def _safe(text: str) -> str:
    """``text`` as one file-system-safe path component (``[A-Za-z0-9._-]``, no leading dot)."""
    out = _UNSAFE.sub("_", text).strip("_") or "_"
    if out.startswith("."):
        out = "_" + out
    if len(out) > _MAX_NAME:  # keep it readable and unique: a prefix plus a hash of the whole
        out = out[: _MAX_NAME - 9] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return out


def default_run_name(cell: Cell) -> str:
    """A file-system-safe run name for ``cell``, e.g. ``weight_split-cpu-float32-b2-T128-h4-d256-forward``.

    ``compiled:sdpa@max-autotune`` becomes ``compiled_sdpa_max-autotune``, ``cuda:1`` becomes ``cuda_1``.
    """
    impl = _safe(cell.impl)
    parts = [impl, _safe(cell.device), _safe(cell.dtype), f"b{cell.batch}", f"T{cell.seq_len}",
             f"h{cell.num_heads}", f"d{cell.d_model}", _safe(cell.mode)]
    return "-".join(parts)


def _run_dir(logdir: Path, run_name: str) -> Path:
    """``logdir / run_name`` where each ``/``-separated part of ``run_name`` is made safe (no ``..``, no root)."""
    parts = [p for p in run_name.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts:
        raise SweepError(f"run name {run_name!r} is empty; give a folder name such as 'sdpa-small'")
    return logdir.joinpath(*(_safe(p) for p in parts))


def _worker_name() -> str:
    """``host_pid`` as torch's default, with dots replaced (they would split the span in the file name)."""
    return f"{_safe(socket.gethostname()).replace('.', '-')}_{os.getpid()}"


def profile_cell(cell: Cell, logdir: str | Path = "runs", wait: int = 1, warmup: int = 2, active: int = 3,
                 record_shapes: bool = True, profile_memory: bool = True, with_stack: bool = True,
                 run_name: str | None = None) -> ProfileResult:
    """Profile ``cell`` and write its trace into ``logdir/<run_name>/`` (one TensorBoard run).

    Runs ``wait + warmup + active`` steps of the cell's mode (device synchronised after each step);
    only the ``active`` steps are recorded. Activities: CPU, plus CUDA for a CUDA cell. Raises
    :class:`~attnbench.errors.AttnbenchError` subclasses for impossible cells before anything is
    written. Another call with the same run name adds a trace file (a new span) to the same run.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise SweepError(f"{name} must be an integer >= {low}, got {value!r}")
    workload = build_workload(cell)  # validates impl, device, dtype, sizes and mode first
    logdir = Path(logdir).expanduser().resolve()
    run_dir = _run_dir(logdir, run_name if run_name is not None else default_run_name(cell))
    run_dir.mkdir(parents=True, exist_ok=True)

    activities = [ProfilerActivity.CPU]
    if workload.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    handler = tensorboard_trace_handler(str(run_dir), worker_name=_worker_name(), use_gzip=False)
    written: list[Path] = []

    def on_trace_ready(prof) -> None:
        before = set(run_dir.glob("*" + TRACE_SUFFIX))
        handler(prof)
        written.extend(sorted(set(run_dir.glob("*" + TRACE_SUFFIX)) - before))

    meta = json.dumps({**cell.as_dict(), "cell_id": cell.cell_id, "torch": torch.__version__,
                       "wait": wait, "warmup": warmup, "active": active})
    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                   on_trace_ready=on_trace_ready, record_shapes=record_shapes, profile_memory=profile_memory,
                   with_stack=with_stack)
    # kineto prints "USDT: ... profiler_start/stop" lines straight to file descriptor 2 as the schedule
    # starts and stops recording: silenced around the profiler's own calls (never around the workload).
    with native_stderr():
        prof.start()
    try:
        for i in range(wait + warmup + active):
            if i == wait + warmup:  # recording has started: the metadata lands in this window's trace
                prof.add_metadata_json("attnbench", meta)
            (workload.timed_step or workload.step)()
            synchronize(workload.device)
            if workload.restore is not None:  # a decode cache restored between steps: not part of a step's work
                with torch.profiler.record_function("attnbench: restore the KV cache (not timed)"):
                    workload.restore()
            with native_stderr():
                prof.step()
    finally:
        with native_stderr():
            prof.stop()
    if not written:  # tensorboard_trace_handler always writes; this would be a torch change
        raise RuntimeError(f"torch.profiler wrote no trace into {run_dir}")
    ops = ops_table(prof, cell)
    return ProfileResult(cell=cell, logdir=logdir, run_dir=run_dir, trace_files=tuple(written), ops=ops,
                         active_steps=active)


def ops_table(prof, cell: Cell) -> pd.DataFrame:
    """The operator table of a finished profiler (columns :data:`OPS_COLUMNS`), most self time first.

    Rows are the host-side entries of ``prof.key_averages()``: operators (``aten::...``), user
    annotations and, on CUDA, runtime calls (``cudaLaunchKernel`` ...). Left out: the Python-stack
    frames that ``with_stack`` adds, the ``ProfilerStep#N`` markers, ``[memory]`` records, and the
    device-side entries (kernels, memcpy): a kernel's time is already in the ``self_device_s`` of the
    operator that launched it, so ``self_device_s`` sums to the device time without double counting
    (the kernels themselves are in the trace and in TensorBoard's Kernel view).
    Sorted by self device time on CUDA, else by self CPU time.
    """
    from torch.autograd import DeviceType

    python_keys = {e.key for e in prof.events() if getattr(e, "is_python_function", False)}
    rows = []
    for avg in prof.key_averages():
        if (avg.key in python_keys or avg.key.startswith("ProfilerStep") or avg.key == "[memory]"
                or avg.device_type != DeviceType.CPU):
            continue
        rows.append({
            "impl": cell.impl, "cell_id": cell.cell_id, "op": avg.key, "calls": int(avg.count),
            "self_cpu_s": avg.self_cpu_time_total * 1e-6, "cpu_total_s": avg.cpu_time_total * 1e-6,
            "self_device_s": float(getattr(avg, "self_device_time_total", 0.0) or 0.0) * 1e-6,
            "device_total_s": float(getattr(avg, "device_time_total", 0.0) or 0.0) * 1e-6,
            "self_cpu_memory_bytes": int(avg.self_cpu_memory_usage or 0),
            "cpu_memory_bytes": int(avg.cpu_memory_usage or 0),
        })
    df = _typed(pd.DataFrame(rows, columns=list(OPS_COLUMNS)))
    first = "self_device_s" if str(cell.device).startswith("cuda") else "self_cpu_s"
    second = "self_cpu_s" if first == "self_device_s" else "self_device_s"
    return df.sort_values([first, second, "op"], ascending=[False, False, True], kind="stable",
                          ignore_index=True)


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    df = df[list(OPS_COLUMNS)].copy()
    for name, kind in OPS_COLUMNS.items():
        df[name] = df[name].astype("string") if kind == "string" else pd.to_numeric(df[name]).astype(kind)
    return df.reset_index(drop=True)


def save_ops(results: list[ProfileResult] | ProfileResult | pd.DataFrame, path: str | Path) -> Path:
    """Write the operator table(s) as Parquet at ``path`` (e.g. ``<run folder>/profile/ops.parquet``).

    Accepts :class:`ProfileResult` objects (their tables are concatenated) or a DataFrame with the
    :data:`OPS_COLUMNS`. Parent folders are created; the file is replaced atomically. Returns ``path``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(results, ProfileResult):
        results = [results]
    if isinstance(results, pd.DataFrame):
        missing = [c for c in OPS_COLUMNS if c not in results.columns]
        if missing:
            raise ValueError(f"operator table lacks columns {missing}; expected {list(OPS_COLUMNS)}")
        df = _typed(results)
    else:
        frames = [r.ops for r in results]
        df = _typed(pd.concat(frames, ignore_index=True)) if frames else _typed(pd.DataFrame(columns=list(OPS_COLUMNS)))
    schema = pa.schema([(n, pa.string() if k == "string" else pa.int64() if k == "int64" else pa.float64())
                        for n, k in OPS_COLUMNS.items()])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(pa.Table.from_pandas(df, schema=schema, preserve_index=False), tmp)
    os.replace(tmp, out)
    return out


def load_ops(path: str | Path) -> pd.DataFrame:
    """Read an ``ops.parquet`` written by :func:`save_ops` (a :class:`ResultsError` if missing or foreign)."""
    import pyarrow.parquet as pq

    p = Path(path)
    if p.is_dir():
        p = p / "ops.parquet"
    if not p.is_file():
        raise ResultsError(f"operator table {p} does not exist; write it with `attnbench run --profile` "
                           "or attnbench.profiling.save_ops")
    try:
        df = pq.read_table(p).to_pandas()
    except Exception as exc:
        raise ResultsError(f"{p} is not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
    missing = [c for c in OPS_COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(f"{p} is not an attnbench operator table: missing columns {missing}")
    return _typed(df)
