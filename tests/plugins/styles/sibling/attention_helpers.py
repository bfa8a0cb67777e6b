"""Helpers the sibling plug-in imports by plain module name."""

from __future__ import annotations

import math

import torch


def split_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(b, T, d) -> (b, nh, T, d/nh)."""
    b, T, d = t.shape
    return t.reshape(b, T, num_heads, d // num_heads).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(b, nh, T, hd) -> (b, T, nh*hd)."""
    return t.transpose(1, 2).flatten(2)


def causal_attention(q, k, v, p: float = 0.0) -> torch.Tensor:
    """Scaled, causally masked softmax attention with dropout ``p`` on the weights: (b, nh, T, hd)."""
    T = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.nn.functional.dropout(scores.softmax(-1), p) @ v
