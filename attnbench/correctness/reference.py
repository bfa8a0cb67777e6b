"""The float64 reference every implementation is compared against.

Written as plainly as possible (one explicit loop over heads, slicing the canonical matrices by rows)
so that it shares no reshape, transpose or mask convention with the implementations under test.
It implements every variant of :class:`~attnbench.spec.AttnSpec`: grouped-query and multi-query
attention (query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``), sliding windows and
non-causal attention.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from attnbench.weights import CanonicalWeights


def allowed_pairs(T_q: int, T_k: int, window: int | None = None, causal: bool = True, offset: int = 0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """``(T_q, T_k)`` bool, True where query ``i`` (at position ``offset + i``) may attend to key ``j``.

    Causal: ``j <= i``; a window ``w`` keeps ``i - j < w`` (causal) or ``|i - j| < w`` (non-causal).
    """
    i = torch.arange(T_q, device=device)[:, None] + offset  # (T_q, 1) query positions
    j = torch.arange(T_k, device=device)[None, :]  # (1, T_k) key positions
    ok = (j <= i) if causal else torch.ones(T_q, T_k, dtype=torch.bool, device=device)
    if window is not None:
        ok = ok & ((i - j).abs() < window)
    return ok


def reference_forward(x: torch.Tensor, w: CanonicalWeights, num_heads: int, *, window: int | None = None,
                      causal: bool = True) -> torch.Tensor:
    """Multi-head attention of ``x`` ``(b, T, d_in)`` with canonical weights ``w``; returns ``(b, T, d_out)``.

    The number of kv heads is read from ``w.W_k``'s rows (``num_kv_heads * head_dim``). Computed in the
    dtype of its inputs (pass float64 for the reference); no dropout.
    """
    b, T, _ = x.shape
    d_out = w.W_q.shape[0]
    hd = d_out // num_heads
    num_kv_heads = w.W_k.shape[0] // hd
    group = num_heads // num_kv_heads  # query heads per kv head
    allowed = allowed_pairs(T, T, window, causal, device=x.device)
    heads = []
    for h in range(num_heads):
        q_rows = slice(h * hd, (h + 1) * hd)
        kv = h // group
        kv_rows = slice(kv * hd, (kv + 1) * hd)

        def proj(W, bias, rows):
            return F.linear(x, W[rows], None if bias is None else bias[rows])  # (b, T, hd)

        q, k, v = proj(w.W_q, w.b_q, q_rows), proj(w.W_k, w.b_k, kv_rows), proj(w.W_v, w.b_v, kv_rows)
        scores = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(hd)  # (b, T, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)  # (b, T, hd)
    context = torch.cat(heads, dim=-1)  # (b, T, d_out), head h in columns h*hd:(h+1)*hd
    return F.linear(context, w.W_o, w.b_o)
