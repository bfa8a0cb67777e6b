"""Pieces the built-in implementations share: the spec-holding base class and per-head weight adapters."""

from __future__ import annotations

import torch
from torch import nn

from attnbench.spec import AttnSpec
from attnbench.weights import Adapter, CanonicalWeights


class AttentionModule(nn.Module):
    """Base of the built-ins: keeps the :class:`AttnSpec` and validates inputs like every layer should."""

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False) -> None:
        super().__init__()
        self.spec = AttnSpec(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads

    def check_input(self, x: torch.Tensor) -> None:
        """Raise :class:`~attnbench.errors.InputShapeError` for a wrong rank, width or length."""
        self.spec.check_input(x)


def add_book_projections(module: nn.Module, d_in: int, d_out: int, qkv_bias: bool) -> None:
    """Give ``module`` the book's projections (``W_query``, ``W_key``, ``W_value``, ``out_proj``), so the
    canonical weights load into it without an adapter."""
    module.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
    module.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
    module.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
    module.out_proj = nn.Linear(d_out, d_out)


def per_head_adapter(query: str, key: str, value: str, out_w: str, out_b: str) -> Adapter:
    """Adapter for layouts with one ``nn.Linear(d_in, head_dim)`` per head and role.

    ``query``/``key``/``value`` are name templates with ``{i}`` for the head index, e.g.
    ``"heads.{i}.W_query"``; head ``i`` owns rows ``i*head_dim:(i+1)*head_dim`` of the canonical matrix.
    """

    def to_state(w: CanonicalWeights, spec: AttnSpec) -> dict[str, torch.Tensor]:
        hd = spec.head_dim
        state: dict[str, torch.Tensor] = {out_w: w.W_o, out_b: w.b_o}
        for i in range(spec.num_heads):
            rows = slice(i * hd, (i + 1) * hd)
            for template, W, b in ((query, w.W_q, w.b_q), (key, w.W_k, w.b_k), (value, w.W_v, w.b_v)):
                state[template.format(i=i) + ".weight"] = W[rows]
                if spec.qkv_bias:
                    state[template.format(i=i) + ".bias"] = b[rows]
        return state

    def from_state(s, spec: AttnSpec) -> CanonicalWeights:
        def gather(template: str, part: str) -> torch.Tensor | None:
            names = [template.format(i=i) + part for i in range(spec.num_heads)]
            return torch.cat([s[n] for n in names]) if names[0] in s else None

        return CanonicalWeights(
            W_q=gather(query, ".weight"), W_k=gather(key, ".weight"), W_v=gather(value, ".weight"),
            b_q=gather(query, ".bias"), b_k=gather(key, ".bias"), b_v=gather(value, ".bias"),
            W_o=s[out_w], b_o=s[out_b],
        )

    return Adapter(to_state, from_state)


def split_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(b, T, d_out)`` -> ``(b, num_heads, T, head_dim)``."""
    b, T, d = t.shape
    return t.view(b, T, num_heads, d // num_heads).transpose(1, 2)  # (b, nh, T, hd)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``(b, num_heads, T, head_dim)`` -> ``(b, T, d_out)``."""
    b, nh, T, hd = t.shape
    return t.transpose(1, 2).contiguous().view(b, T, nh * hd)  # (b, T, d_out)
