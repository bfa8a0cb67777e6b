"""One head's attention probabilities from its scaled scores: the step the float64 references share
(:mod:`attnbench.correctness.reference`, :mod:`attnbench.correctness.mla_reference`)."""

from __future__ import annotations

import torch

from attnbench.correctness.stages import note
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights


def head_probs(scores: torch.Tensor, h: int, w: CanonicalWeights, spec: AttnSpec | None, allowed: torch.Tensor,
               alibi: torch.Tensor | None, lowp: frozenset[str] = frozenset()) -> torch.Tensor:
    """Head ``h``'s attention probabilities ``(b, T, T)`` from its scaled scores ``(b, T, T)``: soft-cap, ALiBi, the
    mask ``allowed``, the sink logit ``w.sinks[h]`` in the denominator, softmax (in float32 when ``lowp`` says)."""
    b, T = scores.shape[0], scores.shape[-1]
    if spec is not None and spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
        note("capped scores", scores, h)
    if alibi is not None:
        scores = scores + alibi[h]
    scores = scores.masked_fill(~allowed, float("-inf"))
    note("masked scores", scores, h)  # issue 47 (attnbench.correctness.stages; nothing kept outside its capture)
    if w.sinks is not None:  # one more logit per query row, dropped after the softmax
        scores = torch.cat([scores, w.sinks[h].to(scores.dtype).expand(b, scores.shape[1], 1)], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(scores.dtype) if "softmax" in lowp else torch.softmax(scores, dim=-1)
    return probs[..., :T]
