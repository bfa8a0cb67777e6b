"""The one constructor every implementation shares: the book's ``MultiHeadAttention`` arguments."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from attnbench.errors import InputShapeError, InvalidSpecError


@dataclass(frozen=True)
class AttnSpec:
    """Sizes of one multi-head attention layer, as the book's constructor takes them.

    ``forward(x)`` of every implementation maps ``(b, T, d_in)`` to ``(b, T, d_out)`` causally for
    every ``T <= context_length``; each of ``num_heads`` heads has width ``head_dim = d_out // num_heads``.
    """

    d_in: int
    d_out: int
    context_length: int
    dropout: float = 0.0
    num_heads: int = 1
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("d_in", "d_out", "context_length", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidSpecError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise InvalidSpecError(f"{name} must be positive, got {value}; pass a size >= 1")
        if self.d_out % self.num_heads:
            divisors = [h for h in range(1, self.d_out + 1) if self.d_out % h == 0]
            close = sorted(divisors, key=lambda h: abs(h - self.num_heads))[:3]
            raise InvalidSpecError(
                f"d_out={self.d_out} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads from {sorted(close)} or a d_out that is a multiple of {self.num_heads}"
            )
        if not 0.0 <= float(self.dropout) < 1.0:
            raise InvalidSpecError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one head: ``d_out // num_heads``."""
        return self.d_out // self.num_heads

    def kwargs(self) -> dict:
        """The constructor's keyword arguments, in the book's order."""
        return asdict(self)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise :class:`InputShapeError` unless ``x`` is ``(b, T, d_in)`` with ``1 <= T <= context_length``."""
        if x.dim() != 3:
            raise InputShapeError(
                f"input must have shape (batch, seq_len, d_in={self.d_in}); got rank {x.dim()} "
                f"shape {tuple(x.shape)}. Add a batch dimension with x.unsqueeze(0)"
            )
        _, seq_len, width = x.shape
        if width != self.d_in:
            raise InputShapeError(f"input width is {width} but the layer was built with d_in={self.d_in}")
        if not 1 <= seq_len <= self.context_length:
            raise InputShapeError(
                f"sequence length {seq_len} is outside 1..context_length={self.context_length}; "
                "build the layer with a larger context_length or shorten the input"
            )
