"""Classes of our own that reproduce conventions real repositories use, each a correct causal MHA (tests/test_roles.py).

* ``TwoInts``: a constructor of two plain ints under names attnbench's tables do not hold (OpenAI Whisper's
  ``MultiHeadAttention(n_state: int, n_head: int)`` convention), fused q/k/v.
* ``Unnamed``: the same with no hint in the names at all (``a``, ``b``): only the probe can tell width from heads.
* ``FlagCausal``: causality by a constructor flag under an unknown name, False by default (``autoregressive``).
* ``Bf16Weights``: ``nn.Linear`` layers built in bfloat16 through a class attribute.
* ``OptionalMasks``: a required forward parameter with a plural name typed ``Optional``, None on its SDPA path.
* ``NeedsLayout``: a required ``str`` the probe cannot choose (``attnbench adapt`` writes a TODO for it).
* ``BrokenInit``: a constructor that raises at every size (the first true cause is construction).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def _sdpa(q, k, v, heads, causal=True, mask=None):
    B, T, C = q.shape  # (B, T, C)
    q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    return y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)


class TwoInts(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_state, 3 * n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        return self.out(_sdpa(q, k, v, self.n_head))


class Unnamed(TwoInts):
    def __init__(self, a, b):
        super().__init__(a, b)


class FlagCausal(nn.Module):
    def __init__(self, d_model: int, n_heads: int, autoregressive: bool = False):
        super().__init__()
        self.h, self.autoregressive = n_heads, autoregressive
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x):
        return self.o(_sdpa(self.q(x), self.k(x), self.v(x), self.h, causal=self.autoregressive))


class Bf16Weights(nn.Module):
    param_dtype = torch.bfloat16

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.h = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False, dtype=self.param_dtype)
                                          for _ in range(4))

    def forward(self, x):
        return self.o(_sdpa(self.q(x), self.k(x), self.v(x), self.h))


class OptionalMasks(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.h = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x, masks: Optional[torch.Tensor]):  # noqa: UP045  (the convention reproduced: typing.Optional)
        return self.wo(_sdpa(self.wq(x), self.wk(x), self.wv(x), self.h, mask=masks))


class NeedsLayout(TwoInts):
    def __init__(self, width: int, n_head: int, layout: str):
        assert layout in ("bthd", "bhtd"), layout
        super().__init__(width, n_head)


class BrokenInit(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model, no_such_argument=True)

    def forward(self, x):
        return x


class WholeBlock(nn.Module):
    """A transformer block (Whisper's ``ResidualAttentionBlock`` shape): norms, attention, MLP, residuals."""

    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.attn, self.attn_ln = TwoInts(n_state, n_head), nn.LayerNorm(n_state)
        self.mlp, self.mlp_ln = nn.Sequential(nn.Linear(n_state, 4 * n_state), nn.GELU(), nn.Linear(4 * n_state, n_state)), \
            nn.LayerNorm(n_state)

    def forward(self, x):
        x = x + self.attn(self.attn_ln(x))
        return x + self.mlp(self.mlp_ln(x))
