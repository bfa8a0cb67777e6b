"""Why a cell is as fast as it is: its roofline coordinates, against ceilings measured on this machine (issue 49).

A cell does ``flops`` of useful work (:func:`attnbench.measure.flops.analytic_flops`: masked pairs and real tokens
only) and must move at least :func:`min_bytes` to and from memory. Against the machine's two ceilings, a compute rate
``P`` (GFLOP/s of a large GEMM in the cell's dtype) and a memory bandwidth ``W`` (GB/s, STREAM-like copy and triad),
it cannot take less than the **attainable time** ``max(flops / P, bytes / W)``. Each ok row gets:

* ``min_bytes``: what the cell must move, each tensor once (:func:`min_bytes`); ``intensity``: ``flops / min_bytes``
  (FLOP per byte);
* ``bound``: ``compute`` or ``memory``, whichever term of the attainable time is larger;
* ``attainable_s`` and ``headroom`` = ``median_s / attainable_s`` (1: on the roofline; 20: twenty times slower than
  the ceilings allow, so there is room to go faster; below 1 a memory-bound cell whose bytes stayed in a cache,
  which the DRAM bandwidth does not limit);
* ``ceiling_gflops_per_s``, ``ceiling_gflops_rel``, ``ceiling_gbytes_per_s``, ``ceiling_gbytes_rel``: the ceilings
  used and their relative uncertainty (the spread of the tries, at least :data:`MIN_REL`); ``ceiling_cache_bytes``:
  the last-level cache of the device (a cell's bytes below :data:`RESIDENT_FACTOR` times it may stay in it);
* ``plausibility``: ``implausible`` when the achieved GFLOP/s exceeds the compute ceiling by more than its uncertainty,
  or the achieved GB/s exceeds the bandwidth by more than its uncertainty while the bytes cannot stay in a cache
  (:data:`RESIDENT_FACTOR`); ``plausible`` otherwise; empty when not judged (no ceiling, not ok). The usual causes
  are a FLOP count that credits skipped work or a timer that missed work.

The compute ceiling used is the larger of the cached one and the run's own peak (``peak_gflops_per_s``, measured
in the same process and measured again when a cell beat it): either may have met a busy moment.

**Ceilings** are measured once per machine, dtype and thread count (a GEMM in each dtype,
:func:`attnbench.measure.flops.gemm_rates`; the copy and triad, :func:`attnbench.measure.bandwidth.stream_rates`;
about a second or two per dtype) and cached in ``$ATTNBENCH_CEILINGS_FILE``, else
``$XDG_CACHE_HOME/attnbench/ceilings.json`` (``~/.cache``), each with its date and conditions (torch, threads, GEMM
size, array bytes, tries, load average; on CUDA the device's properties). ``python -m attnbench.measure.roofline``
prints them (``--again``: measure anew).

Only layer-scope cells get bytes: a block or a model moves its MLP and embedding weights and activations, which this
model does not count, so their rows have no intensity, bound or headroom (their plausibility is still judged on
compute).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from attnbench.errors import ResultsError
from attnbench.measure.machine_file import load_entries, save_entry

ENV_FILE = "ATTNBENCH_CEILINGS_FILE"
"""Environment variable naming the ceilings file (default: ``~/.cache/attnbench/ceilings.json``)."""
GEMM_BUDGET_S = 1.0
"""Seconds of GEMM timing per dtype (split over :data:`~attnbench.measure.flops.PEAK_TRIES` tries)."""
GEMM_SAMPLES = 3
"""The least calls each GEMM try times (a large GEMM's calls vary little)."""
MAX_CALL_S = 0.25
"""The longest GEMM call a ceiling is measured with (:func:`gemm_side`): a try is then a second at the most."""
STREAM_BUDGET_S = 0.5
"""Seconds of copy and triad timing per device and thread count (shared by every dtype)."""
MIN_REL = 0.02
"""The least relative uncertainty a ceiling is given: three tries that agree closely still miss a clock's boost."""
RESIDENT_FACTOR = 4
"""A cell moving fewer bytes than this many times the last-level cache may be served from it (STREAM's rule):
beating the DRAM bandwidth there is not implausible."""
DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes whose ceilings ``python -m attnbench.measure.roofline`` measures by default."""

NUMBER_COLUMNS = ("min_bytes", "intensity", "attainable_s", "headroom")
CEILING_COLUMNS = ("ceiling_gflops_per_s", "ceiling_gflops_rel", "ceiling_gbytes_per_s", "ceiling_gbytes_rel",
                   "ceiling_cache_bytes")
LAYER_MODES = ("inference", "forward", "forward+backward", "decode")


@dataclass(frozen=True)
class Ceiling:
    """The ceilings of one device, dtype and thread count: GEMM GFLOP/s and STREAM GB/s with their relative
    uncertainties, the last-level cache's bytes, when they were measured and under which conditions."""

    gflops_per_s: float
    gflops_rel: float
    gbytes_per_s: float
    gbytes_rel: float
    cache_bytes: float
    date: str = ""
    conditions: dict = field(default_factory=dict)

    def columns(self) -> dict[str, float]:
        """The ``ceiling_*`` columns of a row."""
        return dict(zip(CEILING_COLUMNS, (self.gflops_per_s, self.gflops_rel, self.gbytes_per_s, self.gbytes_rel,
                                          self.cache_bytes), strict=True))

    @classmethod
    def from_entry(cls, entry: dict) -> Ceiling:
        """A ceiling from its entry in the ceilings file."""
        return cls(**{k: entry[k] for k in cls.__dataclass_fields__ if k in entry})


# ---------------------------------------------------------------- the ceilings file


def ceilings_path() -> Path:
    """``$ATTNBENCH_CEILINGS_FILE``, else ``$XDG_CACHE_HOME/attnbench/ceilings.json`` (``~/.cache`` when unset): kept
    outside any repository, it describes a machine."""
    if os.environ.get(ENV_FILE):
        return Path(os.environ[ENV_FILE])
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "attnbench" / "ceilings.json"


def machine_key(device: str, dtype: str, threads: int) -> str:
    """The entry of one machine's ceiling: host, the hardware (CPU model and count, or the GPU's name), dtype,
    thread count and torch version (another torch may bring other GEMM kernels)."""
    from attnbench.devices import cpu_model, parse_device_type

    kind = parse_device_type(device)
    hardware = f"cuda:{torch.cuda.get_device_name(torch.device(device))}" if kind == "cuda" else \
        f"cpu:{cpu_model()}x{os.cpu_count()}"
    return f"{socket.gethostname()}|{hardware}|{dtype}|threads={threads}|torch={torch.__version__}"


def load_ceilings(path: Path | None = None) -> dict[str, dict]:
    """Every entry of the ceilings file ({} when there is none); a corrupt file is a :class:`ResultsError` naming it."""
    return load_entries(path or ceilings_path(), ResultsError, "roofline ceilings",
                        "delete it (they are measured again) or run `python -m attnbench.measure.roofline --again`")


def save_ceiling(key: str, ceiling: Ceiling, path: Path | None = None) -> Path:
    """Write (or replace) one entry of the ceilings file, atomically; the file's path."""
    path = path or ceilings_path()
    return save_entry(path, load_ceilings(path), key, asdict(ceiling))


# ---------------------------------------------------------------- measuring the ceilings


def spread(rates: list[float]) -> float:
    """The relative uncertainty of the best of ``rates``: ``(best - worst) / best``, at least :data:`MIN_REL`."""
    best = max(rates)
    return max((best - min(rates)) / best, MIN_REL) if best > 0 else math.nan


def last_level_cache_bytes(device: str) -> float:
    """The device's last-level cache in bytes: a GPU's L2 (its properties), a CPU's highest cache level in sysfs
    (NaN when unknown)."""
    from attnbench.devices import parse_device_type

    if parse_device_type(device) == "cuda":
        return float(getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", math.nan))
    best = (0, math.nan)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KMGkmg")
        if digits.isdigit() and level >= best[0]:
            best = (level, float(int(digits) * scale))
    return best[1]


def device_conditions(device: str, gemm_n: int) -> dict:
    """What a ceiling was measured under: torch, threads, GEMM size, STREAM array bytes, tries, load average; on CUDA
    the device's properties (name, capability, SMs, memory, L2, and the memory bus's nominal GB/s where torch says)."""
    from attnbench.devices import parse_device_type
    from attnbench.environment import load_average
    from attnbench.measure import bandwidth, flops

    kind = parse_device_type(device)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads() if kind == "cpu" else 0,
           "gemm_n": gemm_n, "tries": flops.PEAK_TRIES,
           "stream_array_bytes": bandwidth.CUDA_ARRAY_BYTES if kind == "cuda" else bandwidth.CPU_ARRAY_BYTES,
           "load_average_1m": load_average()}
    if kind == "cuda":
        p = torch.cuda.get_device_properties(torch.device(device))
        out["device"] = {k: getattr(p, k) for k in ("name", "major", "minor", "multi_processor_count", "total_memory",
                                                    "L2_cache_size", "memory_clock_rate", "memory_bus_width")
                         if hasattr(p, k)}
        clock, bus = out["device"].get("memory_clock_rate"), out["device"].get("memory_bus_width")
        if clock and bus:  # kHz, bits; double data rate
            out["device"]["nominal_gbytes_per_s"] = 2 * clock * 1e3 * bus / 8 / 1e9
    return out


_stream: dict[tuple[str, int], list[float]] = {}


def gemm_side(device: str, dtype: str) -> int:
    """The GEMM side a ceiling is measured with: :func:`~attnbench.measure.flops.gemm_size`, halved (to 128 at the
    least) while one call takes more than :data:`MAX_CALL_S` (a dtype emulated on a CPU runs at a fraction of a
    GFLOP/s, and its rate hardly depends on the side)."""
    from attnbench.devices import parse_device_type, to_dtype
    from attnbench.measure import flops

    kind, dt = parse_device_type(device), to_dtype(dtype)
    side = flops.gemm_size(kind, dt)
    while kind == "cpu" and side > 128:
        a = torch.ones(side, side, dtype=dt)
        start = time.perf_counter()
        torch.mm(a, a)  # the first call (packing, threads) is slower: fast enough then, fast enough
        if time.perf_counter() - start <= MAX_CALL_S:
            break
        side //= 2
    return side


def measure_ceiling(device: str, dtype: str) -> Ceiling:
    """Measure the ceilings of ``device`` and ``dtype`` in this process's thread count: the GEMM's tries and (once per
    device and thread count) the copy and triad's."""
    from attnbench.devices import parse_device_type
    from attnbench.measure import bandwidth, flops

    threads = torch.get_num_threads() if parse_device_type(device) == "cpu" else 0
    side = gemm_side(device, dtype)
    gemm = flops.gemm_rates(device, dtype, GEMM_BUDGET_S, n=side, min_samples=GEMM_SAMPLES)
    if (device, threads) not in _stream:
        _stream[(device, threads)] = bandwidth.stream_rates(device, STREAM_BUDGET_S)
    stream = _stream[(device, threads)]
    return Ceiling(max(gemm), spread(gemm), max(stream), spread(stream), last_level_cache_bytes(device),
                   datetime.now().astimezone().isoformat(timespec="seconds"),
                   {**device_conditions(device, side), "gemm_gflops_per_s": gemm, "stream_gbytes_per_s": stream})


_ceilings: dict[str, Ceiling] = {}


def ceiling_for(device: str, dtype: str, again: bool = False) -> Ceiling:
    """The ceiling of ``device`` and ``dtype`` at this process's thread count: from this process, else the ceilings
    file, else measured and saved (``again``: measured and saved anyway; a file that cannot be written is left as it is)."""
    from attnbench.devices import parse_device_type

    key = machine_key(device, dtype, torch.get_num_threads() if parse_device_type(device) == "cpu" else 0)
    if again or key not in _ceilings:
        entry = None if again else load_ceilings().get(key)
        if entry is None:
            ceiling = measure_ceiling(device, dtype)
            with contextlib.suppress(OSError):  # a read-only cache: measured again by the next process, still used here
                save_ceiling(key, ceiling)
        else:
            ceiling = Ceiling.from_entry(entry)
        _ceilings[key] = ceiling
    return _ceilings[key]


# ---------------------------------------------------------------- a row's coordinates


def element_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (a name such as ``bfloat16``)."""
    from attnbench.devices import to_dtype

    return torch.empty((), dtype=to_dtype(dtype)).element_size()


def _number(row: dict, key: str, default: float = math.nan) -> float:
    """``row[key]`` as a float; ``default`` when it is missing, not a number or not finite."""
    try:
        value = float(row.get(key))
    except (TypeError, ValueError):
        return default
    return value if math.isfinite(value) else default


def compute_ceiling(row: dict) -> float:
    """The compute ceiling a row is judged against: the larger of its cached ceiling and its run's own peak."""
    return max(_number(row, "ceiling_gflops_per_s", 0.0), _number(row, "peak_gflops_per_s", 0.0)) or math.nan


def min_bytes(row: dict) -> float:
    """The bytes a layer-scope cell must move at the least, each tensor once (NaN for a block or model).

    Forward (``inference``, ``forward``): the input (``tokens·d_model``), the projection weights (``W_q``, ``W_o``:
    ``d²``; ``W_k``, ``W_v``: ``kv_dim·d``; the output bias ``d``) and the output (``tokens·d_model``); ``tokens`` are
    the real tokens of a variable-length batch (padding moves nothing useful), else ``batch·seq_len``.
    ``forward+backward``: twice that (the output's gradient in, the input's and the weights' gradients out).
    ``decode``: :func:`attnbench.measure.flops.decode_bytes` (the KV cache it attends over, a window's keys only, and
    the weights) plus the new token's input and output. A mask adds no bytes: it lowers the FLOPs (masked pairs are
    not counted), and so the intensity."""
    from attnbench.measure.flops import decode_bytes

    mode = str(row.get("mode"))
    if str(row.get("scope") or "layer") != "layer" or mode not in LAYER_MODES:
        return math.nan
    e = element_bytes(str(row.get("dtype")))
    b, t, d, h = (int(_number(row, k)) for k in ("batch", "seq_len", "d_model", "num_heads"))
    kv_heads = _number(row, "num_kv_heads")
    kv_heads = h if not math.isfinite(kv_heads) or kv_heads <= 0 else int(kv_heads)
    window = _number(row, "window")
    window = int(window) if math.isfinite(window) else None
    if mode == "decode":
        return decode_bytes(b, t, d, d, num_heads=h, num_kv_heads=kv_heads, window=window, element_bytes=e) \
            + 2 * b * d * e
    if row.get("batch_spec"):  # issue 48: the mixed step reads every request's cache besides its new tokens
        from attnbench.runner.mixed import min_bytes as mixed_min_bytes

        return mixed_min_bytes(str(row["batch_spec"]), d, d // h * kv_heads, e)
    tokens = int(_number(row, "tokens")) if row.get("lengths") and _number(row, "tokens") > 0 else b * t
    kv_dim = d // h * kv_heads
    weights = 2 * d * d + 2 * kv_dim * d + d
    forward = float((2 * tokens * d + weights) * e)
    return 2 * forward if mode == "forward+backward" else forward


def coordinates(row: dict) -> dict:
    """The roofline columns of ``row`` from its ``flops``, ``median_s``, shape and ``ceiling_*`` columns (see the
    module); NaN / empty where one is missing. Pure: remade whenever the median changes (rounds merged)."""
    out = {**dict.fromkeys(NUMBER_COLUMNS, math.nan), "bound": "", "plausibility": ""}
    flops, median, nbytes = _number(row, "flops"), _number(row, "median_s"), min_bytes(row)
    if math.isfinite(nbytes) and nbytes > 0:
        out["min_bytes"] = nbytes
        out["intensity"] = flops / nbytes if math.isfinite(flops) else math.nan
    compute = compute_ceiling(row)
    bandwidth = _number(row, "ceiling_gbytes_per_s")
    if row.get("status") != "ok" or not (math.isfinite(flops) and median > 0 and compute > 0):
        return out
    t_compute = flops / (compute * 1e9)
    t_memory = nbytes / (bandwidth * 1e9) if math.isfinite(nbytes) and bandwidth > 0 else math.nan
    if math.isfinite(t_memory):
        out["bound"] = "compute" if t_compute >= t_memory else "memory"
        out["attainable_s"] = max(t_compute, t_memory)
        out["headroom"] = median / out["attainable_s"]
    over_compute = flops / median / 1e9 > compute * (1 + _number(row, "ceiling_gflops_rel", MIN_REL))
    resident = _number(row, "ceiling_cache_bytes") * RESIDENT_FACTOR
    over_memory = (math.isfinite(t_memory) and not nbytes < resident
                   and nbytes / median / 1e9 > bandwidth * (1 + _number(row, "ceiling_gbytes_rel", MIN_REL)))
    out["plausibility"] = "implausible" if over_compute or over_memory else "plausible"
    return out


def record(row: dict, device: str) -> None:
    """Add the ceilings of ``device`` and the row's dtype (:func:`ceiling_for`: measured here when not cached) and the
    roofline columns to an ok ``row``, in place; a ceiling that cannot be had leaves them missing, said in ``notes``."""
    try:
        ceiling = ceiling_for(device, str(row["dtype"]))
    except (RuntimeError, OSError) as exc:  # a dtype's GEMM unsupported here, an unreadable ceilings file (ResultsError)
        row["notes"] = "; ".join(n for n in (row.get("notes"), f"no roofline: {str(exc).splitlines()[0][:200]}") if n)
        return
    row.update(ceiling.columns())
    row.update(coordinates(row))


# ---------------------------------------------------------------- views


def implausible_rows(df):
    """The rows of results ``df`` flagged ``implausible`` (none for a run older than the column)."""
    if "plausibility" not in df.columns:
        return df.iloc[:0]
    return df[df["plausibility"].astype(str) == "implausible"]


def implausible_text(r) -> str:
    """One flagged row in words: which cell, its rate against the ceiling, and the usual causes."""
    r = dict(r)
    compute, achieved = compute_ceiling(r), _number(r, "flops") / _number(r, "median_s") / 1e9
    rel = _number(r, "ceiling_gflops_rel", MIN_REL)
    if achieved > compute * (1 + rel):
        said = f"{achieved:.4g} GFLOP/s above the measured ceiling of {compute:.4g} (±{100 * rel:.0f}%)"
    else:
        said = (f"{_number(r, 'min_bytes') / _number(r, 'median_s') / 1e9:.4g} GB/s above the measured bandwidth of "
                f"{_number(r, 'ceiling_gbytes_per_s'):.4g} (±{100 * _number(r, 'ceiling_gbytes_rel', MIN_REL):.0f}%)")
    return (f"{r.get('cell_id')}: {said}: a FLOP count that credits work the implementation skipped, or a timer "
            "that missed work")


def main(argv: list[str] | None = None) -> int:
    """Print this machine's ceilings per dtype (measured and cached when missing; ``--again``: measured anew)."""
    parser = argparse.ArgumentParser(prog="python -m attnbench.measure.roofline", description=main.__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", action="append", help=f"repeatable (default: {', '.join(DTYPES)})")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--again", action="store_true", help="measure anew and replace the cached entries")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for dtype in args.dtype or DTYPES:
        c = ceiling_for(args.device, dtype, again=args.again)
        print(f"{args.device} {dtype} threads={c.conditions.get('threads')}: {c.gflops_per_s:,.1f} GFLOP/s "
              f"(±{100 * c.gflops_rel:.1f}%), {c.gbytes_per_s:,.1f} GB/s (±{100 * c.gbytes_rel:.1f}%), "
              f"last-level cache {c.cache_bytes / 2**20:.0f} MiB; measured {c.date}, load {c.conditions.get('load_average_1m')}")
    print(f"cached in {ceilings_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
