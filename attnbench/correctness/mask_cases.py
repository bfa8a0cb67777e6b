"""The mask cases of the correctness matrix (issue 37): ALiBi, prefix-LM, documents, attention sinks, and their
compositions with windows, soft-capping, GQA and non-causal attention (:mod:`attnbench.correctness.masks`).

Each shape runs ``forward`` (float64, float32) and ``backward`` (float64: the gradients of the input and of every
canonical parameter, the sink logits included) against the float64 reference, where an implementation declares the
masks it sets (``masks=``, ``softcap``, ``sliding_window``, ...), and is skipped with the reason elsewhere. What they
vary is what mask bugs hide behind: ALiBi at a head count that is not a power of two (the slopes' second rule) and
with heads that differ by a factor of 4 (slopes in reversed head order change every head), a prefix longer than one
token (a causal prefix differs from a bidirectional one only there), document starts at odd places (a leak of one
token across a start changes the first token of the next document), and sink logits that differ per head and
between -1 and 2 (a sink added after the softmax, or on the wrong head, moves every row).
"""

from __future__ import annotations

from attnbench.correctness.cases import Case, Shape
from attnbench.spec import AttnSpec

MASK_SHAPES = [
    Shape("alibi", 2, 12, AttnSpec(16, 16, 12, 0.0, 4, alibi=True)),
    Shape("alibi_6heads_window", 2, 13, AttnSpec(24, 24, 16, 0.0, 6, alibi=True, window=5)),  # not a power of two
    Shape("prefix", 2, 11, AttnSpec(16, 16, 12, 0.0, 2, prefix=5)),
    Shape("prefix_alibi_gqa", 1, 10, AttnSpec(32, 32, 10, 0.0, 4, num_kv_heads=2, prefix=3, alibi=True)),
    Shape("document", 2, 12, AttnSpec(16, 16, 12, 0.0, 2, documents=(3, 7))),
    Shape("document_noncausal_bias", 2, 11, AttnSpec(16, 16, 12, 0.0, 2, True, causal=False, documents=(4, 5, 9))),
    Shape("sink", 2, 9, AttnSpec(16, 16, 12, 0.0, 4, sinks=True)),
    Shape("sink_gqa_window", 2, 10, AttnSpec(32, 32, 12, 0.0, 4, num_kv_heads=1, window=3, sinks=True)),
    Shape("softcap_alibi_sink_doc", 2, 12, AttnSpec(16, 16, 12, 0.0, 4, softcap=2.0, alibi=True, sinks=True,
                                                    documents=(5,))),
]
"""Run where the implementation declares what they set."""


def cases() -> list[Case]:
    """Forward (float64, float32) and backward (float64) of every :data:`MASK_SHAPES`."""
    out: list[Case] = []
    for shape in MASK_SHAPES:
        out += [Case("forward", shape, "float64"), Case("forward", shape, "float32"), Case("backward", shape, "float64")]
    return out


def exercised(specs: list[AttnSpec]) -> str:
    """What of the masks ``specs`` (the run cases' specs) exercised: ``"masks (alibi, prefix, sink)"``, or ``""``."""
    kinds = sorted({k for s in specs for k in s.mask_kinds})
    return f"masks ({', '.join(kinds)})" if kinds else ""
