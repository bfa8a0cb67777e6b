"""Hand-written math variants: one fused QKV projection, and einsum throughout."""

from __future__ import annotations

import torch
from torch import nn

from attnbench.implementations._common import AttentionModule, merge_heads
from attnbench.plugins.catalog import register
from attnbench.spec import AttnSpec
from attnbench.weights import Adapter, CanonicalWeights


def _causal_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float, dropout: nn.Dropout) -> torch.Tensor:
    """Masked, scaled softmax over the last axis: ``scores`` is ``(b, nh, T, T)``, ``mask`` True above the diagonal."""
    T = scores.shape[-1]
    scores = scores.masked_fill(mask[:T, :T], float("-inf"))
    return dropout(torch.softmax(scores * scale, dim=-1))  # (b, nh, T, T)


def _fused_to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    state = {"qkv.weight": torch.cat([w.W_q, w.W_k, w.W_v]), "out_proj.weight": w.W_o, "out_proj.bias": w.b_o}
    if spec.qkv_bias:
        state["qkv.bias"] = torch.cat([w.b_q, w.b_k, w.b_v])
    return state


def _fused_from_state(s, spec: AttnSpec) -> CanonicalWeights:
    W_q, W_k, W_v = s["qkv.weight"].chunk(3)
    b_q, b_k, b_v = s["qkv.bias"].chunk(3) if "qkv.bias" in s else (None, None, None)
    return CanonicalWeights(W_q, W_k, W_v, b_q, b_k, b_v, s["out_proj.weight"], s["out_proj.bias"])


class FusedQKVAttention(AttentionModule):
    """One Linear(d_in, 3*d_out) projects queries, keys and values in a single GEMM."""

    weight_adapter = Adapter(_fused_to_state, _fused_from_state)

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1),
                             persistent=False)

    def forward(self, x):
        self.check_input(x)
        b, T, _ = x.shape
        qkv = self.qkv(x).view(b, T, 3, self.num_heads, self.head_dim)  # (b, T, 3, nh, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, nh, T, hd)
        weights = _causal_softmax(q @ k.transpose(-2, -1), self.mask, self.head_dim ** -0.5, self.dropout)
        return self.out_proj(merge_heads(weights @ v))  # (b, T, d_out)


def _einsum_to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    nh, hd = spec.num_heads, spec.head_dim
    state = {"w_q": w.W_q.reshape(nh, hd, spec.d_in), "w_k": w.W_k.reshape(nh, hd, spec.d_in),
             "w_v": w.W_v.reshape(nh, hd, spec.d_in), "w_o": w.W_o.reshape(spec.d_out, nh, hd), "b_o": w.b_o}
    if spec.qkv_bias:
        state.update({"b_q": w.b_q.reshape(nh, hd), "b_k": w.b_k.reshape(nh, hd), "b_v": w.b_v.reshape(nh, hd)})
    return state


def _einsum_from_state(s, spec: AttnSpec) -> CanonicalWeights:
    def flat(name: str, *shape: int) -> torch.Tensor | None:
        return s[name].reshape(*shape) if name in s else None

    d_in, d_out = spec.d_in, spec.d_out
    return CanonicalWeights(flat("w_q", d_out, d_in), flat("w_k", d_out, d_in), flat("w_v", d_out, d_in),
                            flat("b_q", d_out), flat("b_k", d_out), flat("b_v", d_out),
                            flat("w_o", d_out, d_out), s["b_o"])


class EinsumAttention(AttentionModule):
    """Every contraction written as torch.einsum over per-head weight tensors (nh, hd, d_in)."""

    weight_adapter = Adapter(_einsum_to_state, _einsum_from_state)

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        nh, hd = num_heads, self.head_dim
        bound = d_in ** -0.5
        self.w_q = nn.Parameter(torch.empty(nh, hd, d_in).uniform_(-bound, bound))
        self.w_k = nn.Parameter(torch.empty(nh, hd, d_in).uniform_(-bound, bound))
        self.w_v = nn.Parameter(torch.empty(nh, hd, d_in).uniform_(-bound, bound))
        self.b_q = nn.Parameter(torch.zeros(nh, hd)) if qkv_bias else None
        self.b_k = nn.Parameter(torch.zeros(nh, hd)) if qkv_bias else None
        self.b_v = nn.Parameter(torch.zeros(nh, hd)) if qkv_bias else None
        self.w_o = nn.Parameter(torch.empty(d_out, nh, hd).uniform_(-(d_out ** -0.5), d_out ** -0.5))
        self.b_o = nn.Parameter(torch.zeros(d_out))
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1),
                             persistent=False)

    def _project(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = torch.einsum("bti,hdi->bhtd", x, w)  # (b, nh, T, hd)
        return out if b is None else out + b[None, :, None, :]

    def forward(self, x):
        self.check_input(x)
        q = self._project(x, self.w_q, self.b_q)  # (b, nh, T, hd)
        k = self._project(x, self.w_k, self.b_k)
        v = self._project(x, self.w_v, self.b_v)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k)  # (b, nh, T, T)
        weights = _causal_softmax(scores, self.mask, self.head_dim ** -0.5, self.dropout)
        context = torch.einsum("bhqk,bhkd->bhqd", weights, v)  # (b, nh, T, hd)
        return torch.einsum("bhtd,ohd->bto", context, self.w_o) + self.b_o  # (b, T, d_out)


register("fused_qkv", FusedQKVAttention, source="common practice (nanoGPT c_attn): one QKV GEMM")
register("einsum", EinsumAttention, source="torch.einsum formulation (e.g. public MHA benchmarks)")
