"""The decode property: prefill, then token-by-token decoding with a KV cache, equals the full forward.

For a module with the KV-cache protocol (``implementations/kv_cache.py``): prefill ``prefill`` tokens
in one call, then decode the rest one token at a time; each output must equal the full-sequence
reference at that position. Along the way it checks what the decode timer relies on (decoding a
token, rewinding it and decoding it again gives the same output) and, after ``reset_cache()``, that a
different sequence decodes as if nothing had been cached before (a cache not cleared on reset fails).
With a sliding window shorter than the sequence, decoding runs across the window's wrap-around.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attnbench.plugins import cache_state

PROTOCOL = ("reset_cache",)
"""What a cache needs besides ``forward(x, use_cache=True)``: a reset method (any name in
:data:`attnbench.plugins.cache_state.RESET_METHODS`); ``rewind_cache`` is optional (restored otherwise)."""


def missing_protocol(module: nn.Module) -> list[str]:
    """The KV-cache protocol methods ``module`` lacks (``forward(x, use_cache=True)`` is called, not inspected)."""
    return [] if cache_state.reset_method(module) else ["reset_cache (or reset_kv_cache, clear_cache, ...)"]


def decode_error(module: nn.Module, x: torch.Tensor, ref: torch.Tensor, prefill: int,
                 error: Callable[[torch.Tensor, torch.Tensor], float]) -> tuple[float, str]:
    """The worst ``error(out, ref)`` over a prefill and token-by-token decode of ``x`` ``(b, T, d_in)``, and where.

    ``ref`` ``(b, T, d_out)`` is the full forward of ``x``. Called twice per check: the second time
    after ``reset_cache()`` with another input, so a stale cache shows.
    """
    worst, where = 0.0, ""
    cache_state.reset_cache(module)
    with torch.no_grad(), cache_state.default_dtype(x.dtype):  # a cache made with torch.zeros gets the case's dtype
        out = module(x[:, :prefill], use_cache=True)
        err = error(out, ref[:, :prefill])
        if err > worst:
            worst, where = err, f"prefill of {prefill} tokens"
        for t in range(prefill, x.shape[1]):
            if t == x.shape[1] - 2:  # the timer decodes one position again and again: rewind (or restore) and repeat
                out, again, how = decode_twice(module, x[:, t:t + 1])
                err = error(again, ref[:, t:t + 1])
                if err > worst:
                    worst, where = err, f"position {t} decoded again after {how}"
            else:
                out = module(x[:, t:t + 1], use_cache=True)
            err = error(out, ref[:, t:t + 1])
            if err > worst:
                worst, where = err, f"decoded token at position {t}"
    return worst, where


def decode_twice(module: nn.Module, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Decode ``x_t`` ``(b, 1, d_in)``, undo it the way the decode timer does, and decode it again: both outputs
    and how it was undone. Without ``rewind_cache`` the cache state is snapshotted and restored
    (:mod:`attnbench.plugins.cache_state`); a restored step that decodes another token raises
    :class:`~attnbench.plugins.cache_state.CacheRestoreError` (state out of attnbench's reach)."""
    if callable(getattr(getattr(module, "_orig_mod", module), "rewind_cache", None)):
        out = module(x_t, use_cache=True)
        module.rewind_cache(1)
        return out, module(x_t, use_cache=True), "rewind_cache(1)"
    restore = cache_state.step_restorer(module, lambda: module(x_t, use_cache=True))
    out = module(x_t, use_cache=True)
    restore()
    return out, module(x_t, use_cache=True), "restoring the cache state"
