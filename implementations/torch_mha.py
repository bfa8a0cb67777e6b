"""``torch.nn.MultiheadAttention`` with a causal mask and ``need_weights=False`` (its fast path)."""

from __future__ import annotations

import torch
from torch import nn

from attnbench.implementations._common import AttentionModule
from attnbench.plugins.catalog import register
from attnbench.spec import AttnSpec
from attnbench.weights import Adapter, CanonicalWeights


def _to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
    state = {"mha.in_proj_weight": torch.cat([w.W_q, w.W_k, w.W_v]),
             "mha.out_proj.weight": w.W_o, "mha.out_proj.bias": w.b_o}
    if spec.qkv_bias:
        state["mha.in_proj_bias"] = torch.cat([w.b_q, w.b_k, w.b_v])
    return state


def _from_state(s, spec: AttnSpec) -> CanonicalWeights:
    W_q, W_k, W_v = s["mha.in_proj_weight"].chunk(3)
    b_q, b_k, b_v = s["mha.in_proj_bias"].chunk(3) if spec.qkv_bias else (None, None, None)
    return CanonicalWeights(W_q, W_k, W_v, b_q, b_k, b_v, s["mha.out_proj.weight"], s["mha.out_proj.bias"])


class TorchMHA(AttentionModule):
    """nn.MultiheadAttention(batch_first=True) with a boolean causal mask and need_weights=False.

    nn.MultiheadAttention has one bias switch for the input and output projections; the canonical
    layer always has an output bias, so without ``qkv_bias`` the input bias is kept at zero and frozen.
    Its query width is its embedding width, so it needs ``d_in == d_out``.
    """

    weight_adapter = Adapter(_to_state, _from_state)

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        if d_in != d_out:
            raise ValueError(f"nn.MultiheadAttention needs d_in == d_out, got {d_in} and {d_out}")
        self.mha = nn.MultiheadAttention(d_out, num_heads, dropout=dropout, bias=True, batch_first=True)
        if not qkv_bias:
            with torch.no_grad():
                self.mha.in_proj_bias.zero_()
            self.mha.in_proj_bias.requires_grad_(False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1),
                             persistent=False)

    def forward(self, x):
        self.check_input(x)
        T = x.shape[1]
        out, _ = self.mha(x, x, x, attn_mask=self.mask[:T, :T], need_weights=False, is_causal=True)
        return out  # (b, T, d_out)


register("torch_mha", TorchMHA, source="torch.nn.MultiheadAttention (need_weights=False, causal bool mask)",
         same_width_only=True)
