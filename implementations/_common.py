"""Pieces the built-in implementations share: the spec-holding base class and per-head weight adapters."""

from __future__ import annotations

import torch
from torch import nn

from attnbench.spec import AttnSpec
from attnbench.weights import Adapter, CanonicalWeights


class AttentionModule(nn.Module):
    """Base of the built-ins: keeps the :class:`AttnSpec` and validates inputs like every layer should."""

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False, num_kv_heads: int | None = None, window: int | None = None,
                 causal: bool = True) -> None:
        super().__init__()
        self.spec = AttnSpec(d_in, d_out, context_length, dropout, num_heads, qkv_bias, num_kv_heads, window, causal)
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.num_kv_heads = self.spec.kv_heads
        self.group = num_heads // self.num_kv_heads  # query heads per kv head
        self.window = window
        self.causal = causal

    def check_input(self, x: torch.Tensor) -> None:
        """Raise :class:`~attnbench.errors.InputShapeError` for a wrong rank, width or length."""
        self.spec.check_input(x)


def add_book_projections(module: nn.Module, d_in: int, d_out: int, qkv_bias: bool, kv_dim: int | None = None) -> None:
    """Give ``module`` the book's projections (``W_query``, ``W_key``, ``W_value``, ``out_proj``), so the
    canonical weights load into it without an adapter. ``kv_dim`` (``num_kv_heads * head_dim``) is the
    width of keys and values for grouped-query attention (default ``d_out``)."""
    module.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
    module.W_key = nn.Linear(d_in, kv_dim or d_out, bias=qkv_bias)
    module.W_value = nn.Linear(d_in, kv_dim or d_out, bias=qkv_bias)
    module.out_proj = nn.Linear(d_out, d_out)


def visible(T_q: int, T_k: int, window: int | None, causal: bool, device: torch.device,
            key_pos: torch.Tensor | None = None, q_start: int | None = None) -> torch.Tensor | None:
    """``(T_q, T_k)`` bool mask, True = may attend (SDPA's meaning), or ``None`` when every pair is visible.

    Queries sit at positions ``q_start .. q_start + T_q - 1`` (default: the last ``T_q`` of ``T_k``);
    keys at ``key_pos`` (default ``0 .. T_k - 1``; a rolling cache passes its slots' positions, -1 = empty).
    Causal keeps keys at or before the query; a window ``w`` keeps the ``w`` most recent of them
    (``|i - j| < w`` when not causal).
    """
    if key_pos is None and (q_start is None or q_start == T_k - T_q):
        if not causal and window is None:
            return None
        offset = T_k - T_q  # query i is at key position i + offset
        ones = torch.ones(T_q, T_k, dtype=torch.bool, device=device)
        upper = ones.tril(offset) if causal else ones.tril(offset + window - 1)
        return upper if window is None else upper & ~ones.tril(offset - window)
    start = T_k - T_q if q_start is None else q_start
    q = torch.arange(start, start + T_q, device=device)[:, None]  # (T_q, 1)
    k = (torch.arange(T_k, device=device) if key_pos is None else key_pos)[None, :]  # (1, T_k)
    ok = k >= 0
    if causal:
        ok = ok & (k <= q)
    if window is not None:
        ok = ok & ((q - k).abs() < window)
    return ok


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
