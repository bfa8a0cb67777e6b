"""Devices and dtypes by name: parsing, availability, synchronisation."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from attnbench.errors import SweepError, UnavailableError

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
           "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name (``float32`` ...) of a dtype or dtype alias; :class:`SweepError` if unknown."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise SweepError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
    name = ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    if name not in DTYPES:
        raise SweepError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} (or fp32, bf16, fp16, fp64)")
    return name


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The ``torch.dtype`` for a name or alias."""
    return DTYPES[dtype_name(dtype)]


def cuda_available() -> bool:
    """True when a CUDA device can be used (never initialises CUDA when the build has none)."""
    return torch.backends.cuda.is_built() and torch.cuda.is_available()


def parse_device_type(device: str | torch.device) -> str:
    """``cpu`` or ``cuda`` for a device string, without checking the device exists (:class:`SweepError` if unknown)."""
    try:
        kind = torch.device(str(device).strip().lower()).type
    except RuntimeError as exc:
        raise SweepError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if kind not in ("cpu", "cuda"):
        raise SweepError(f"device type {kind!r} is not supported; use cpu, cuda or cuda:N")
    return kind


def parse_device(device: str | torch.device) -> torch.device:
    """A ``torch.device`` for ``cpu``, ``cuda`` or ``cuda:N`` that exists here, else :class:`UnavailableError`."""
    text = str(device).strip().lower()
    try:
        dev = torch.device(text)
    except RuntimeError as exc:
        raise SweepError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise SweepError(f"device type {dev.type!r} is not supported; use cpu, cuda or cuda:N")
    if not cuda_available():
        raise UnavailableError(f"device {text!r} requested but CUDA is not available here "
                               f"(torch {torch.__version__}); use --device cpu or run on a CUDA machine")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise UnavailableError(f"device {text!r} does not exist: this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A human name of the hardware behind ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``platform`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
