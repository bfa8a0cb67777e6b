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

    Variants (the defaults are the book's causal multi-head attention):

    * ``num_kv_heads``: heads of keys and values (``None`` = ``num_heads``: MHA; 1: MQA; a divisor of
      ``num_heads``: GQA). Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``, so
      consecutive query heads share a kv head (``repeat_interleave``, not ``repeat``);
    * ``window``: ``None`` for full attention; ``w`` lets each token attend to itself and the previous
      ``w - 1`` tokens (a sliding window);
    * ``causal``: ``False`` for bidirectional (encoder) attention, where every token sees every token
      (of its window, when there is one: ``|i - j| < w``).
    """

    d_in: int
    d_out: int
    context_length: int
    dropout: float = 0.0
    num_heads: int = 1
    qkv_bias: bool = False
    num_kv_heads: int | None = None
    window: int | None = None
    causal: bool = True

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
        if self.num_kv_heads is not None:
            kv = self.num_kv_heads
            if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.num_heads % kv:
                divisors = [h for h in range(1, self.num_heads + 1) if self.num_heads % h == 0]
                raise InvalidSpecError(f"num_kv_heads={kv!r} does not divide num_heads={self.num_heads}; "
                                       f"choose num_kv_heads from {divisors}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1):
            raise InvalidSpecError(f"window={self.window!r} must be an int >= 1 (1 = each token sees only itself), "
                                   "or None for full attention")
        if not isinstance(self.causal, bool):
            raise InvalidSpecError(f"causal must be True or False, got {self.causal!r}")

    @property
    def head_dim(self) -> int:
        """Width of one head: ``d_out // num_heads``."""
        return self.d_out // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: ``num_kv_heads``, or ``num_heads`` when it is ``None``."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        """Rows of the canonical ``W_k`` and ``W_v``: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def is_variant(self) -> bool:
        """Whether this is anything but the book's causal multi-head attention (GQA/MQA, a window, non-causal)."""
        return self.kv_heads != self.num_heads or self.window is not None or not self.causal

    def variant_kwargs(self) -> dict:
        """The variant fields that differ from the book's defaults (what a variant-aware constructor takes)."""
        out: dict = {}
        if self.kv_heads != self.num_heads:
            out["num_kv_heads"] = self.kv_heads
        if self.window is not None:
            out["window"] = self.window
        if not self.causal:
            out["causal"] = False
        return out

    def kwargs(self) -> dict:
        """The constructor's keyword arguments, in the book's order, plus the variant fields that differ
        from the defaults (so ``AttnSpec(**spec.kwargs()) == spec``)."""
        book = {k: v for k, v in asdict(self).items() if k not in ("num_kv_heads", "window", "causal")}
        return {**book, **self.variant_kwargs()}

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
