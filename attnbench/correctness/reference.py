"""The float64 reference every implementation is compared against.

Written as plainly as possible (one explicit loop over heads, slicing the canonical matrices by rows)
so that it shares no reshape, transpose or mask convention with the implementations under test.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from attnbench.weights import CanonicalWeights


def reference_forward(x: torch.Tensor, w: CanonicalWeights, num_heads: int) -> torch.Tensor:
    """Causal multi-head attention of ``x`` ``(b, T, d_in)`` with canonical weights ``w``; returns ``(b, T, d_out)``.

    Computed in the dtype of its inputs (pass float64 for the reference); no dropout.
    """
    b, T, _ = x.shape
    d_out = w.W_q.shape[0]
    hd = d_out // num_heads
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # query i sees keys j <= i
    heads = []
    for h in range(num_heads):
        rows = slice(h * hd, (h + 1) * hd)

        def proj(W, bias, rows=rows):
            return F.linear(x, W[rows], None if bias is None else bias[rows])  # (b, T, hd)

        q, k, v = proj(w.W_q, w.b_q), proj(w.W_k, w.b_k), proj(w.W_v, w.b_v)
        scores = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(hd)  # (b, T, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)  # (b, T, hd)
    context = torch.cat(heads, dim=-1)  # (b, T, d_out), head h in columns h*hd:(h+1)*hd
    return F.linear(context, w.W_o, w.b_o)
