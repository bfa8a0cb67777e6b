"""DeepSeek-style MLA shapes of the matrix (issue 46): forward and backward cases against
:mod:`attnbench.correctness.mla_reference`.

They run where an implementation declares MLA (``mla = True`` on its factory,
:func:`attnbench.correctness.cases.mla_skip_reason`) and are skipped with the reason elsewhere; the decode shapes of
MLA are in :data:`attnbench.correctness.decode.DECODE_SHAPES`. The runners are the plain ``forward`` and ``backward``
ones (:mod:`attnbench.correctness.basic`): only the shapes are new.
"""

from __future__ import annotations

from attnbench.correctness.cases import Case, Shape
from attnbench.spec import AttnSpec

MLA_SHAPES = [
    # a low-rank query (q_lora_rank, its latent normed), interleaved RoPE (DeepSeek's pairs), 4 heads
    Shape("mla_qlora", 2, 9, AttnSpec(32, 32, 12, 0.0, 4, rope_theta=100.0, rope_style="interleaved",
                                      q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
                                      v_head_dim=5)),
    # a full-rank query, rotate-half pairs, d_in != d_out, qk_rope_head_dim == qk_nope_head_dim
    Shape("mla_full_q_din_ne_dout", 3, 7, AttnSpec(24, 16, 10, 0.0, 2, rope_theta=1000.0, kv_lora_rank=12,
                                                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6)),
    # a score scale of its own (DeepSeek's YaRN mscale folds into it), one head, T == context_length
    Shape("mla_scaled_one_head", 2, 8, AttnSpec(16, 16, 8, 0.0, 1, rope_theta=500.0, rope_style="interleaved",
                                                scale=0.2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4,
                                                qk_rope_head_dim=2, v_head_dim=8)),
]


def cases() -> list[Case]:
    """Forward (float64, float32) and backward (float64, float32) on every MLA shape."""
    return [Case(kind, shape, dtype) for shape in MLA_SHAPES for kind in ("forward", "backward")
            for dtype in ("float64", "float32")]
