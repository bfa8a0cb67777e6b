"""The positional cases of the correctness matrix (issue 26): RoPE, QK-norm, score scale and soft-capping.

Each shape below runs ``forward`` (float64, float32) and ``backward`` (float64) against the float64 reference
where an implementation declares what the shape sets (``rope``, ``qk_norm``, ``score_scale``, ``softcap``),
and is skipped with the reason elsewhere. What they vary is what RoPE and QK-norm bugs hide behind: a theta
other than 10,000 (100 and 500,000 with Llama-3 scaling), both RoPE styles, QK-norm gains that differ from 1
and between q and k, over each head and over the whole projection, a score scale other than
``head_dim ** -0.5``, and a soft-cap that bends the scores.

**Positions.** RoPE is relative: a prefill whose every position is shifted by the same amount gives the
same output, so that is no bug, and a prefill starting past 0 is compared with the reference *there*
(:func:`run_start_positions`, case kind ``rope_start``: the class is told the start, ``forward(x,
start_pos=p)``), which catches queries and keys rotated at different offsets. Absolute positions are
checked where they matter: decoding, where cached keys sit at ``0 .. n - 1`` and the new token at ``n``
(the RoPE decode shapes in :mod:`attnbench.correctness.decode`: single tokens and chunks, the new tokens
rotated at their positions, cached keys rotated once).
"""

from __future__ import annotations

import pandas as pd
import torch

from attnbench.correctness.cases import Case, CaseResult, Shape, build, inputs, rel_error, row, seed_for, tolerance
from attnbench.devices import DTYPES
from attnbench.plugins import signatures
from attnbench.spec import AttnSpec, RopeScaling
from attnbench.weights import random_weights

LLAMA3_SMALL = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=256)
"""Llama-3 scaling shrunk so head_dim 16 has all three bands: wavelengths under 64 kept, over 256 divided by 8,
the one between (about 163 at theta 500,000) blended."""

POSITIONAL_SHAPES = [  # run where the implementation declares what they set
    Shape("rope_llama3_gqa", 2, 13, AttnSpec(64, 64, 16, 0.0, 4, num_kv_heads=2, rope_theta=500_000.0,
                                               rope_scaling=LLAMA3_SMALL)),
    Shape("rope_interleaved_theta100_bias", 2, 9, AttnSpec(16, 16, 12, 0.0, 2, True, rope_theta=100.0,
                                                             rope_style="interleaved")),
    Shape("qknorm_head_rope_mqa", 2, 9, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=1, rope_theta=100.0,
                                                   qk_norm="head")),
    Shape("qknorm_full_rope_window", 2, 11, AttnSpec(16, 16, 12, 0.0, 2, rope_theta=1000.0, qk_norm="full", window=4)),
    # QK-norm without RoPE (round 14): a class that owns its norms but no rotary tables had no QK-norm case at all
    Shape("qknorm_head_plain", 2, 8, AttnSpec(16, 16, 8, 0.0, 2, qk_norm="head")),
    Shape("qknorm_full_plain", 2, 8, AttnSpec(16, 16, 8, 0.0, 2, qk_norm="full")),
    # another epsilon: run by the classes that take one (a class whose norms keep their own skips it, with the reason)
    Shape("qknorm_head_eps", 2, 8, AttnSpec(16, 16, 8, 0.0, 2, rope_theta=100.0, qk_norm="head", norm_eps=1e-5)),
    # plain rotate-half RoPE (no scaling, no QK-norm): what a class owning unscaled tables (HF-style, the book's
    # Llama 3.2 GQA) computes, so such a class is checked against RoPE too
    Shape("rope_half_theta500_gqa", 2, 10, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=2, rope_theta=500.0)),
    # partial rotary (issue 46): the first 8 of each head's 16 dims rotated, GPT-NeoX's (half pairs inside the slice)
    # and GPT-J's (interleaved pairs); run by the classes that take the rotated part (rotary_dim, rotary_pct, ...)
    Shape("rope_partial_half", 2, 10, AttnSpec(32, 32, 12, 0.0, 2, rope_theta=100.0, rope_head_dim=8)),
    Shape("rope_partial_interleaved", 2, 9, AttnSpec(32, 32, 12, 0.0, 2, rope_theta=100.0, rope_style="interleaved",
                                                       rope_head_dim=8)),
    Shape("score_scale", 2, 8, AttnSpec(16, 16, 8, 0.0, 2, scale=0.9)),
    # a cap other than 1: at 1, ``tanh(s / cap)`` without its ``cap *`` is the right function (a planted set found it)
    Shape("softcap", 2, 8, AttnSpec(16, 16, 8, 0.0, 2, softcap=2.0)),
]
START_SHAPES = [Shape("rope_start", 2, 6, AttnSpec(16, 16, 16, 0.0, 2, rope_theta=100.0, qk_norm="head")),
                Shape("rope_start_plain", 2, 6, AttnSpec(16, 16, 16, 0.0, 2, rope_theta=100.0))]  # no QK-norm
STARTS = (3, 10)
"""Start positions of ``rope_start``: past 0, and the last that fits (10 + 6 = context_length, the tables' end)."""
START_NAMES = ("start_pos",)
"""Forward parameters that tell a module where its tokens start (plug-in binding adds more: i26b)."""


def cases() -> list[Case]:
    """The positional cases: forward/backward of :data:`POSITIONAL_SHAPES` and the start positions."""
    out: list[Case] = []
    for shape in POSITIONAL_SHAPES:
        out += [Case("forward", shape, "float64"), Case("forward", shape, "float32"), Case("backward", shape, "float64")]
    return out + [Case("rope_start", shape, dtype) for shape in START_SHAPES for dtype in ("float64", "float32")]


def start_argument(module: torch.nn.Module) -> str | None:
    """The name of ``module.forward``'s start-position parameter (:data:`START_NAMES`), or ``None``."""
    params = signatures.signature(getattr(module, "_orig_mod", module).forward).parameters
    return next((n for n in START_NAMES if n in params), None)


def run_start_positions(impl, case: Case, device: torch.device) -> CaseResult:
    """A prefill told to start at each of :data:`STARTS` equals the reference at those absolute positions."""
    spec = case.shape.spec
    built = build(impl, spec, device, case.dtype, random_weights(spec, seed=seed_for(case.shape)))
    name = start_argument(built.module)
    if name is None:
        return row(impl, case, device, "skip", None, None, f"forward takes no start position ({', '.join(START_NAMES)})")
    x = inputs(case.shape).to(DTYPES[case.dtype])
    tol, worst = tolerance(case.dtype), 0.0
    for start in STARTS:
        try:
            with torch.no_grad():
                out = built.module(x.to(device), **{name: start}).cpu()
        except IndexError as exc:
            if not tables_end_at(exc, case.shape.seq_len):
                raise
            return row(impl, case, device, "skip", None, None, f"its own constraint: its rotary tables end at the "
                       f"tokens it is given ({name}={start} raised {exc}); a start past 0 comes with a cache of that "
                       "length, which the decode cases check")
        err = rel_error(out, built.reference(x, start_pos=start))
        if err > tol:
            return row(impl, case, device, "fail", err, tol, f"rope_start: tokens at positions {start}.."
                       f"{start + case.shape.seq_len - 1} ({name}={start}): error {err:.3g} > tolerance {tol:.2g}")
        worst = max(worst, err)
    return row(impl, case, device, "pass", worst, tol)


def tables_end_at(exc: IndexError, tokens: int) -> bool:
    """Did indexing a table of exactly ``tokens`` rows raise (4.x-era Hugging Face copies build ``cos`` for the
    ``kv_seq_len`` it sees, past + new, and index it with the position ids: EAGLE's ``LlamaAttention``)? A table of
    another size that ends too early is a bug the case reports."""
    return str(exc).endswith(f"out of bounds for dimension 0 with size {tokens}")


RUNNERS = {"rope_start": run_start_positions}
CASE_MODES: dict[str, str] = {}


def exercised(results: pd.DataFrame, shapes: dict[str, AttnSpec]) -> dict[str, str]:
    """Per implementation, what of RoPE / QK-norm / score scale / softcap its run cases (not skipped) exercised:
    ``"RoPE (half, interleaved; theta 100, 500000; llama3 scaling; start positions; decode offsets), ..."``."""
    out = {}
    for impl, rows in results[results.status != "skip"].groupby("impl", sort=False):
        specs = [(shapes[s], k) for s, k in zip(rows["shape"], rows["kind"], strict=True) if s in shapes]
        text = _words([s for s, _ in specs], {k for _, k in specs})
        if text:
            out[impl] = text
    return out


def _words(specs: list[AttnSpec], kinds: set[str]) -> str:
    rope = [s for s in specs if s.rope_theta is not None]
    parts = []
    if rope:
        details = [", ".join(sorted({s.rope_style for s in rope})),
                   "theta " + ", ".join(f"{t:g}" for t in sorted({s.rope_theta for s in rope}))]
        details += ["llama3 scaling"] * any(s.rope_scaling is not None for s in rope)
        details += ["start positions"] * ("rope_start" in kinds) + ["decode offsets"] * ("decode" in kinds)
        parts.append(f"RoPE ({'; '.join(details)})")
    norms = sorted({s.qk_norm for s in specs if s.qk_norm is not None})
    if norms:
        parts.append(f"QK-norm ({', '.join(norms)})")
    parts += ["score scale"] * any(s.scale is not None for s in specs)
    parts += ["softcap"] * any(s.softcap is not None for s in specs)
    return ", ".join(parts)
