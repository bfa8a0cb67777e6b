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

PROTOCOL = ("reset_cache", "rewind_cache")


def missing_protocol(module: nn.Module) -> list[str]:
    """The KV-cache protocol methods ``module`` lacks (``forward(x, use_cache=True)`` is called, not inspected)."""
    base = getattr(module, "_orig_mod", module)
    return [name for name in PROTOCOL if not callable(getattr(base, name, None))]


def decode_error(module: nn.Module, x: torch.Tensor, ref: torch.Tensor, prefill: int,
                 error: Callable[[torch.Tensor, torch.Tensor], float]) -> tuple[float, str]:
    """The worst ``error(out, ref)`` over a prefill and token-by-token decode of ``x`` ``(b, T, d_in)``, and where.

    ``ref`` ``(b, T, d_out)`` is the full forward of ``x``. Called twice per check: the second time
    after ``reset_cache()`` with another input, so a stale cache shows.
    """
    worst, where = 0.0, ""
    module.reset_cache()
    with torch.no_grad():
        out = module(x[:, :prefill], use_cache=True)
        err = error(out, ref[:, :prefill])
        if err > worst:
            worst, where = err, f"prefill of {prefill} tokens"
        for t in range(prefill, x.shape[1]):
            out = module(x[:, t:t + 1], use_cache=True)
            err = error(out, ref[:, t:t + 1])
            if err > worst:
                worst, where = err, f"decoded token at position {t}"
            if t == x.shape[1] - 2:  # the timer decodes one position again and again: rewind and repeat
                module.rewind_cache(1)
                again = module(x[:, t:t + 1], use_cache=True)
                err = error(again, ref[:, t:t + 1])
                if err > worst:
                    worst, where = err, f"position {t} decoded again after rewind_cache(1)"
    return worst, where
