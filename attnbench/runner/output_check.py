"""Whether a workload's step returned a valid result (shared by the layer, varlen and mixed-step workloads)."""

from __future__ import annotations

import torch


def output_problem(out, want: tuple[int, ...], dtype: torch.dtype, what: str, dtype_is: str = "input dtype") -> str | None:
    """Why ``out`` is not a valid result: not a tensor, a shape other than ``want`` (``what`` names it), another dtype
    than ``dtype`` (``dtype_is`` names where it comes from), non-finite values; ``None`` when it is valid."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if tuple(out.shape) != want:
        return f"{what} {tuple(out.shape)} != expected {want}"
    if out.dtype != dtype:
        return f"output dtype {out.dtype} != {dtype_is} {dtype}"
    if not bool(torch.isfinite(out.detach()).all()):
        return "output has non-finite values (nan/inf)"
    return None
