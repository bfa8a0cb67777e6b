"""Chronos-2's convention (issue 46, round 20), reproduced in our own code: a forward that returns a dataclass
(``AttentionOutput(hidden_states, attn_weights)``, as a Hugging Face ``ModelOutput``) and takes a required additive
``(B, H, Q, K)`` mask. attnbench's mask probe compared the returned objects and crashed with a traceback."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionOutput:
    hidden_states: torch.Tensor | None = None
    attn_weights: torch.Tensor | None = None


class DataclassOutput(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.d_kv = num_heads, d_model // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, hidden_states, mask, output_attentions=False):
        B, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, T, self.num_heads, self.d_kv).transpose(1, 2) for p in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(3, 2) / self.d_kv ** 0.5 + mask, dim=-1)
        out = self.o((weights @ v).transpose(1, 2).reshape(B, T, -1))
        return AttentionOutput(hidden_states=out, attn_weights=weights if output_attentions else None)
