"""Rotary position embeddings and RMSNorm, as small functions (the reference's and the built-in ``rope`` family's).

Conventions (:data:`attnbench.spec.ROPE_STYLES`): ``half`` pairs dimension ``j`` with ``j + head_dim/2``
(``rotate_half``: Llama/HF/NeoX), ``interleaved`` pairs ``2j`` with ``2j + 1`` (GPT-J, the original Meta code);
pair ``j`` turns by ``position * inv_freq[j]`` in both. A rotary slice narrower than the head (issue 46,
:func:`apply_rope_part`) rotates the first ``r`` dimensions (partial rotary) or the last ones (DeepSeek MLA's
``[nope | rope]`` query heads) with tables of width ``r``, pairs inside that slice; the rest pass unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attnbench.spec import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``(head_dim // 2,)`` angular frequencies ``theta ** (-2j / head_dim)``, Llama-3-scaled when ``scaling`` is given."""
    freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None:
        freq = llama3_scaled(freq, scaling)
    return freq.to(dtype)


def llama3_scaled(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3 frequency scaling: long wavelengths divided by ``factor``, short kept, the band between blended."""
    wavelen = 2 * math.pi / freq
    long_wave = s.original_context_length / s.low_freq_factor
    short_wave = s.original_context_length / s.high_freq_factor
    smooth = (s.original_context_length / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * freq / s.factor + smooth * freq
    out = torch.where(wavelen > long_wave, freq / s.factor, freq)
    return torch.where((wavelen >= short_wave) & (wavelen <= long_wave), blended, out)


def rope_tables(positions: Sequence[int] | torch.Tensor, head_dim: int, theta: float,
                scaling: RopeScaling | None = None, style: str = "half",
                dtype: torch.dtype = torch.float64,
                compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(len(positions), head_dim)``: the angle of pair ``j`` at ``positions[t]`` in the
    columns ``style`` gives it (``half``: ``cat(a, a)``; ``interleaved``: ``repeat_interleave(a, 2)``).

    ``compute_dtype`` float32 computes the frequencies, angles, cos and sin in float32, as Hugging Face's, Meta's
    and the book's table builders do (the floor a class with float32 tables is judged against)."""
    pos = torch.as_tensor(positions, dtype=compute_dtype).reshape(-1, 1)
    freq = inv_freq(head_dim, theta, scaling)
    if compute_dtype != torch.float64:  # the frequencies as float32 code computes them: theta ** (-2j/d) in float32
        freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=compute_dtype) / head_dim)
        freq = llama3_scaled(freq, scaling) if scaling is not None else freq
    angles = pos * freq[None, :]  # (T, head_dim // 2)
    full = torch.cat([angles, angles], dim=-1) if style == "half" else angles.repeat_interleave(2, dim=-1)
    return full.cos().to(dtype), full.sin().to(dtype)


def rotate(x: torch.Tensor, style: str = "half") -> torch.Tensor:
    """The quarter turn of every pair of ``x`` ``(..., head_dim)``: ``(a, b) -> (-b, a)``."""
    if style == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half") -> torch.Tensor:
    """``x`` ``(..., T, head_dim)`` rotated by tables ``(T, head_dim)`` (:func:`rope_tables`)."""
    return x * cos.to(x.dtype) + rotate(x, style) * sin.to(x.dtype)


def apply_rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half",
                    part: str = "first") -> torch.Tensor:
    """``x`` ``(..., T, d)`` with only ``r = cos.shape[-1]`` of its dimensions rotated by tables ``(T, r)``: the
    ``first`` ``r`` (partial rotary: GPT-NeoX, Phi, ``partial_rotary_factor``) or the ``last`` ``r`` (DeepSeek MLA's
    query heads ``[nope | rope]``); pairs are formed inside that slice (:func:`rotate`), the rest pass unchanged."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin, style)
    if part == "first":
        return torch.cat([apply_rope(x[..., :r], cos, sin, style), x[..., r:]], dim=-1)  # (..., T, d)
    if part == "last":
        return torch.cat([x[..., :-r], apply_rope(x[..., -r:], cos, sin, style)], dim=-1)  # (..., T, d)
    raise ValueError(f"part={part!r}; use 'first' or 'last'")


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6,
             compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * gain`` (the normalisation in ``compute_dtype``
    when given, as classes that norm in float32 whatever the input do; the gain in ``x``'s dtype)."""
    xc = x if compute_dtype is None else x.to(compute_dtype)
    normed = (xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return normed * gain.to(x.dtype)
