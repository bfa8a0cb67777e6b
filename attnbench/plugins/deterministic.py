"""``deterministic:NAME`` (issue 48): ``NAME`` with ``torch.use_deterministic_algorithms(True)`` around every call
(the name is resolved by :mod:`attnbench.registry`, as ``compiled:NAME`` is).

Determinism has a price on some devices: PyTorch's deterministic mode swaps kernels that use atomics (CUDA's
``index_add``, scatter-adds, some backward passes) for slower ordered ones, and raises where it has none. To make that
price a number, give both to one sweep: ``attnbench run --impl sdpa,deterministic:sdpa``. The two are one comparison
group (they differ only in the implementation), timed in alternation, so the row of ``deterministic:sdpa`` holds the
paired speed-up of the deterministic mode against the default, with its interval.

The module is the base implementation built as usual (the same weights), wrapped so that each call switches the mode
on and puts back what it found afterwards. The wrapper keeps the base under ``_orig_mod`` (as ``torch.compile`` does),
so the cache protocols and the weight layout are the base's. On CUDA, cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
in the environment for the mode; without it a call raises, and the row says so. torch's first switch to the mode in a
process imports Inductor's configuration (it sets Inductor's deterministic mode too): seconds, once, in the cell's
first call, which is not timed.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

PREFIX = "deterministic:"


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside, the mode (and its ``warn_only``) as it was afterwards."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


class DeterministicMode(nn.Module):
    """``inner`` called under :func:`deterministic_algorithms`; every other attribute is ``inner``'s."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._orig_mod = inner

    def forward(self, *args, **kwargs):
        with deterministic_algorithms():
            return self._orig_mod(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("_orig_mod"), name)
