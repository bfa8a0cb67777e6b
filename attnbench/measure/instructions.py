"""Instructions executed per call of a cell, counted by valgrind's callgrind: a measure that load cannot move.

Wall time on a shared 2-vCPU machine moves by 15% with the host; the number of instructions one call of a cell
executes does not, for the same code and inputs, whatever else the machine does. :func:`count_cell` counts it in a
process of its own (:mod:`attnbench.measure.callgrind_worker`) started as::

    setarch -R valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no --cache-sim=no --branch-sim=no \\
        python -m attnbench.measure.callgrind_worker SPEC.json

with the settings that make the count repeatable (:func:`count_env`, recorded in each row's ``instr_settings``):

* one thread (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``, ``torch.set_num_threads(1)``): threads split work
  differently from run to run, and valgrind serialises them anyway;
* address randomisation off (``setarch -R``): pointer values feed hashing and allocator paths;
* a fixed hash seed (``PYTHONHASHSEED=0``) and the ``pinned`` glibc allocator of ``attnbench run``
  (:mod:`attnbench.measure.cpu_env`: fixed mmap and trim thresholds);
* one vector ISA for PyTorch's CPU kernels (``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA`` and MKL's
  ``MKL_ENABLE_INSTRUCTIONS``), default ``avx2``: valgrind's virtual CPU has no AVX-512, so a wall-time run on an
  AVX-512 machine would otherwise run other kernels than the counted one. Export :func:`count_env`'s ISA variables
  (``attnbench.measure.instructions.ISA_ENV``) in a wall-time run you pair with a count. The capability PyTorch
  actually chose is read back in the counted process and recorded in ``cpu_capability``.

The count is per call: ``calls`` calls of the cell's step after ``warmup`` uncounted ones (the first call among them),
less the same loop calling a function that does nothing (the harness's baseline, ``instructions_baseline``). The
counted loop runs ``repeats`` times in the one process (each its own callgrind part): the row's count is their mean,
and ``instr_spread`` (:func:`repeat_spread`) their noise, from which ``attnbench compare`` sets each cell's
threshold (issue 45, :mod:`attnbench.results.compare_instructions`).
``instr_functions`` keeps callgrind's per-function table (exclusive counts per call, the largest
:data:`TOP_FUNCTIONS`), which ``attnbench compare`` diffs to name the functions whose counts changed.

A count cannot see what does not change the instructions: cache misses, memory bandwidth, SIMD width (under one
fixed ISA), frequency, other load, threads. It answers "does this code do more work?", never "is it faster?".
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from attnbench.measure.cpu_env import CpuEnv, process_env

TOOLS = ("valgrind", "callgrind_control", "callgrind_annotate", "setarch")
"""The programs a count needs (valgrind's package ships the first three, util-linux ``setarch``)."""
CAPABILITIES = ("default", "avx2", "avx512", "sve256")
TOP_FUNCTIONS = 60
"""How many functions of callgrind's table a row keeps (by exclusive count per call; the rest as one ``(other)``)."""
INSTRUCTION_COLUMNS = ("instructions", "instructions_baseline", "instr_calls", "instr_repeats", "instr_spread",
                       "instr_count_s", "instr_call_s", "cpu_capability", "instr_functions", "instr_settings")


@dataclass(frozen=True)
class CountSettings:
    """How a cell is counted (recorded per row in ``instr_settings``)."""

    calls: int = 5  # counted calls (the count is exact: a few suffice; fewer make the baseline's share larger)
    repeats: int = 9  # the counted loop, repeated in the same process: their mean is the count, their spread the noise
    warmup: int = 20  # uncounted calls first (the first call included; under 20, Python 3.11's specialising
    # interpreter was still warming up: counts of the smallest cell fell by 2.5% over the 15 calls after 3 warm-up ones)
    capability: str = "avx2"  # ATEN_CPU_CAPABILITY and the oneDNN/MKL limits; "default": no limit (native choice)
    seed: int = 0
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.calls < 1 or self.warmup < 1 or self.repeats < 1:
            raise ValueError(f"a count needs calls, warmup and repeats >= 1, got calls={self.calls}, "
                             f"warmup={self.warmup}, repeats={self.repeats}")
        if self.capability not in CAPABILITIES:
            raise ValueError(f"unknown CPU capability {self.capability!r}; use one of {', '.join(CAPABILITIES)}")


ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
           "sve256": {"ATEN_CPU_CAPABILITY": "sve256"}, "default": {}}
"""The environment that limits PyTorch's CPU kernels (ATen's dispatch, oneDNN, MKL) to one vector ISA."""


def count_env(settings: CountSettings = CountSettings(), base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a counted process: ``attnbench run``'s pinned allocator, one thread, a fixed hash seed and
    the ISA limit of ``settings.capability``."""
    env = process_env(CpuEnv("pinned", bind=False, threads=1), base)
    env.update(PYTHONHASHSEED="0", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **ISA_ENV[settings.capability])
    if settings.capability == "default":
        for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
            env.pop(key, None)
    return env


def unavailable_reason(device: str = "cpu") -> str | None:
    """Why instructions cannot be counted here for a cell on ``device`` (None: they can)."""
    if not str(device).startswith("cpu"):
        return (f"instruction counts are for CPU cells only (valgrind cannot see inside {device} kernels); "
                "measure this cell's time instead (--metric time)")
    if platform.system() != "Linux":
        return f"instruction counts need valgrind on Linux; this is {platform.system()}"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"{', '.join(missing)} not found: install valgrind (Debian/Ubuntu: apt-get install valgrind; "
                "setarch is util-linux's) to count instructions")
    return None


def command(spec_path: Path, out_file: Path) -> list[str]:
    """The counted process's command line (see the module docstring)."""
    return ["setarch", platform.machine(), "-R", "valgrind", "--tool=callgrind", "--instr-atstart=no",
            "--collect-atstart=no", "--cache-sim=no", "--branch-sim=no", f"--callgrind-out-file={out_file}", "-q",
            sys.executable, "-m", "attnbench.measure.callgrind_worker", str(spec_path)]


_TOTAL = re.compile(r"^\s*([0-9,]+)\s+PROGRAM TOTALS")
_FUNCTION = re.compile(r"^\s*(-?[0-9,]+)\s+(\S.*)$")


def parse_annotate(text: str) -> tuple[int, dict[str, int]]:
    """``(total, {function: exclusive count})`` from ``callgrind_annotate --inclusive=no --show-percs=no`` output.
    Function names are :func:`function_name`'s (no build paths), counts of equal names added."""
    total, functions, in_table = None, {}, False
    for line in text.splitlines():
        if total is None:
            m = _TOTAL.match(line)
            total = int(m.group(1).replace(",", "")) if m else None
        elif not in_table:
            in_table = line.strip().startswith("Ir") and "file:function" in line
        elif m := _FUNCTION.match(line):
            name = function_name(m.group(2))
            functions[name] = functions.get(name, 0) + int(m.group(1).replace(",", ""))
        elif line.strip() and not set(line.strip()) <= {"-"}:
            break
    if total is None:
        raise ValueError("callgrind_annotate printed no PROGRAM TOTALS line: not a callgrind profile?")
    return total, functions


def function_name(entry: str) -> str:
    """``file:function [object]`` as ``function [object file name]``: no build or install paths, which differ
    between machines and would keep two runs' tables from matching."""
    obj = ""
    if m := re.search(r"\s\[([^\]]+)\]$", entry):
        obj, entry = f" [{os.path.basename(m.group(1))}]", entry[: m.start()]
    file, sep, function = entry.partition(":")
    if not sep or "(" in file or " " in file:  # no file part (or the colon belonged to a C++ name)
        function = entry
    return f"{function.strip()}{obj}"


def annotate(path: Path) -> tuple[int, dict[str, int]]:
    """:func:`parse_annotate` of ``callgrind_annotate`` on one part file."""
    proc = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", "--show-percs=no", str(path)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"callgrind_annotate {path.name} failed (exit {proc.returncode}): {proc.stderr.strip()[:300]}")
    return parse_annotate(proc.stdout)


def per_call_table(step: dict[str, int], baseline: dict[str, int], calls: int, top: int = TOP_FUNCTIONS) -> dict[str, float]:
    """The step's functions less the baseline's, per call: the ``top`` largest, the rest summed as ``(other)``."""
    names = set(step) | set(baseline)
    diff = {n: (step.get(n, 0) - baseline.get(n, 0)) / calls for n in names}
    ranked = sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
    kept = dict(ranked[:top])
    rest = sum(v for _, v in ranked[top:])
    if rest:
        kept["(other)"] = rest
    return kept


class CountError(RuntimeError):
    """The counted process failed (its output's end is in the message)."""


class CountTimeout(CountError):
    """The counted process ran past ``CountSettings.timeout_s``."""


def count_cell(cell, settings: CountSettings = CountSettings()) -> dict:
    """Count ``cell``'s instructions per call (see the module docstring); the row columns
    :data:`INSTRUCTION_COLUMNS`. The step is counted ``settings.repeats`` times in the one process: ``instructions``
    is their mean per call (``instr_functions`` too), ``instr_spread`` the repeats' :func:`repeat_spread`. Raises
    :class:`CountError` when the counted process fails, and ValueError when :func:`unavailable_reason` gives a reason
    (check it first: that is a ``skipped`` row, not a failure)."""
    reason = unavailable_reason(cell.device)
    if reason:
        raise ValueError(reason)
    t0 = time.perf_counter()
    repeats, calls = settings.repeats, settings.calls
    with tempfile.TemporaryDirectory(prefix="attnbench-callgrind-") as tmp:
        work = Path(tmp)
        spec = work / "spec.json"
        spec.write_text(json.dumps(dict(cell=asdict(cell), calls=calls, warmup=settings.warmup, repeats=repeats,
                                        seed=settings.seed, threads=1)))
        _run_counted(command(spec, work / "callgrind.out"), _with_this_attnbench(count_env(settings)), work,
                     settings.timeout_s, parts=repeats + 1)
        result = json.loads(spec.with_suffix(".result.json").read_text())
        steps = [annotate(work / f"callgrind.out.{i}") for i in range(1, repeats + 1)]
        base_total, base = annotate(work / f"callgrind.out.{repeats + 1}")
    counts = [(total - base_total) / calls for total, _ in steps]
    mean_step = {name: sum(table.get(name, 0) for _, table in steps) / repeats for name in set().union(*(t for _, t in steps))}
    return dict(instructions=statistics.fmean(counts), instructions_baseline=base_total / calls, instr_calls=calls,
                instr_repeats=repeats, instr_spread=repeat_spread(counts), instr_count_s=time.perf_counter() - t0,
                instr_call_s=result["step_s"] / (calls * repeats), cpu_capability=str(result["capability"]),
                instr_functions=json.dumps(per_call_table(mean_step, base, calls), separators=(",", ":")),
                instr_settings=settings_text(settings, result))


def repeat_spread(counts: list[float]) -> float:
    """The noise of a count: ``(max - min) / mean`` of the repeats' instructions per call (0: every repeat counted
    the same); NaN with fewer than 2 repeats (no spread was measured) or a mean that is not positive."""
    if len(counts) < 2:
        return math.nan
    mean = statistics.fmean(counts)
    return (max(counts) - min(counts)) / mean if mean > 0 else math.nan


def _with_this_attnbench(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the folder this attnbench was imported from first on ``PYTHONPATH``: the counted process must
    count this code (under the asv gate, a commit's private install that ``ASV_PYTHONPATH`` put first on
    ``sys.path`` here, not the environment's own install)."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this attnbench package
    env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    return env


def _run_counted(cmd: list[str], env: dict[str, str], work: Path, timeout_s: float, parts: int = 2) -> None:
    """Run the counted process in ``work``; :class:`CountError` with its output's end when it fails or leaves fewer
    than ``parts`` callgrind parts."""
    log = work / "output.txt"
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise CountTimeout(f"counting ran past {timeout_s:g} s (a call under valgrind is about 50x slower than "
                               "a timed one: count smaller shapes, or raise --cell-timeout)") from None
    if proc.returncode != 0 or not (work / f"callgrind.out.{parts}").is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        raise CountError(f"the counted process failed (exit {proc.returncode}): " + " | ".join(tail)[-600:])


def settings_text(settings: CountSettings, result: dict) -> str:
    """What the count ran under, in one line (the row's ``instr_settings``)."""
    isa = ",".join(f"{k}={v}" for k, v in ISA_ENV[settings.capability].items()) or "no ISA limit"
    return (f"callgrind --cache-sim=no, setarch -R, PYTHONHASHSEED=0, malloc pinned"
            f"{'' if result.get('malloc_pinned') else ' (mallopt refused)'}, threads {result.get('threads')}, {isa}, "
            f"{settings.calls} calls after {settings.warmup} warm-up, mean of {settings.repeats} repeats, harness "
            "baseline subtracted")
