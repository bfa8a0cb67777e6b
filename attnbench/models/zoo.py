"""The model zoo: a transformer block and a GPT around any attention implementation.

* :class:`Block`: the pre-LN GPT block (LayerNorm -> attention -> residual -> LayerNorm -> MLP 4x GELU -> residual),
  or, for grouped-query cells (``num_kv_heads`` < heads, the variant Llama-style models use), the Llama-style block
  (RMSNorm, SwiGLU);
* :class:`GPT`: the book's chapter-4 layout: token and position embeddings, N blocks, a final norm, an LM head
  (no bias; no dropout: timings and checks are deterministic).

The surrounding weights (norms, MLPs, embeddings, head) are drawn from a seed under a forked RNG, the same for every
implementation; each attention layer gets canonical weights from its own seed (:func:`layer_weights`). So two models
differ only in the attention implementation inside, which is what a comparison should isolate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from attnbench.correctness.reference import reference_forward
from attnbench.plugins import cache_state
from attnbench.spec import AttnSpec
from attnbench.weights import CanonicalWeights, random_weights


@dataclass(frozen=True)
class ModelShape:
    """What a block or model is: width, heads, the attention variant, blocks, vocabulary and context."""

    d_model: int
    num_heads: int
    layers: int = 1
    vocab: int = 0  # 0: a block alone (no embeddings, no head)
    context: int = 128
    num_kv_heads: int | None = None
    window: int | None = None
    causal: bool = True

    @property
    def llama(self) -> bool:
        """Grouped-query cells get the Llama-style block (RMSNorm, SwiGLU); multi-head ones the GPT block."""
        return self.num_kv_heads is not None and self.num_kv_heads != self.num_heads

    @property
    def spec(self) -> AttnSpec:
        """The spec of every attention layer inside (``d_in = d_out = d_model``, no dropout)."""
        return AttnSpec(self.d_model, self.d_model, self.context, 0.0, self.num_heads, num_kv_heads=self.num_kv_heads,
                        window=self.window, causal=self.causal)


def layer_weights(shape: ModelShape, layer: int, seed: int) -> CanonicalWeights:
    """The canonical (float64) weights of attention layer ``layer``: the same for every implementation."""
    return random_weights(shape.spec, seed=seed * 1009 + layer, scale="linear")


class GELUMLP(nn.Module):
    """The GPT block's feed-forward: Linear(d, 4d), GELU (tanh approximation, as the book's), Linear(4d, d)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """The Llama block's feed-forward: ``w2(silu(w1 x) * w3 x)``, hidden width 8d/3 rounded up to a multiple of 8."""

    def __init__(self, d: int):
        super().__init__()
        hidden = 8 * math.ceil(8 * d / 3 / 8)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm transformer block around ``attn`` (any module mapping (b, T, d) to (b, T, d))."""

    def __init__(self, attn: nn.Module, d: int, llama: bool = False):
        super().__init__()
        norm = (lambda: nn.RMSNorm(d, eps=1e-5)) if llama else (lambda: nn.LayerNorm(d))
        self.norm1, self.norm2 = norm(), norm()
        self.ff = SwiGLU(d) if llama else GELUMLP(d)
        self.attn = attn

    def forward(self, x, use_cache: bool = False):
        h = self.norm1(x)
        x = x + (self.attn(h, use_cache=True) if use_cache else self.attn(h))
        return x + self.ff(self.norm2(x))

    def reset_cache(self) -> None:
        """Forget the attention's cached tokens (through whichever reset method the implementation has)."""
        cache_state.reset_cache(self.attn)


class GPT(nn.Module):
    """The book's chapter-4 GPT: token + position embeddings, blocks, final norm, LM head (no bias)."""

    def __init__(self, blocks: list[Block], vocab: int, d: int, context: int, llama: bool = False):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = nn.RMSNorm(d, eps=1e-5) if llama else nn.LayerNorm(d)
        self.out_head = nn.Linear(d, vocab, bias=False)
        self.pos = 0  # tokens in the KV caches (use_cache=True calls continue from here)

    def forward(self, idx: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        """Logits ``(b, T, vocab)`` of token ids ``idx`` ``(b, T)``; with ``use_cache`` the tokens continue the cached ones."""
        T = idx.shape[1]
        start = self.pos if use_cache else 0
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(start, start + T, device=idx.device))
        for block in self.blocks:
            x = block(x, use_cache=use_cache)
        if use_cache:
            self.pos += T
        return self.out_head(self.final_norm(x))

    def reset_cache(self) -> None:
        """Forget every cached token in every block."""
        for block in self.blocks:
            block.reset_cache()
        self.pos = 0


def surroundings(shape: ModelShape, seed: int) -> tuple[list[nn.Module], nn.Module | None]:
    """The non-attention parts in float64, drawn under a forked RNG from ``seed``: a block's norms and MLP per layer
    (as :class:`Block` shells holding an ``nn.Identity`` attention) and, for a model (``vocab`` > 0), a :class:`GPT`
    shell with those blocks. The same values for every implementation."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with _default_dtype(torch.float64):
            blocks = [Block(nn.Identity(), shape.d_model, shape.llama) for _ in range(shape.layers)]
            model = GPT(blocks, shape.vocab, shape.d_model, shape.context, shape.llama) if shape.vocab else None
    return blocks, model


class _default_dtype:
    def __init__(self, dtype):
        self.dtype, self.before = dtype, None

    def __enter__(self):
        self.before = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.before)


def assemble(shape: ModelShape, seed: int, make_attn: Callable[[int], nn.Module], device, dtype) -> nn.Module:
    """A block (``vocab`` 0, ``layers`` 1) or a GPT in ``dtype`` on ``device``: the seeded surroundings with
    ``make_attn(layer)`` (already on ``device`` in ``dtype``) as the attention of each block."""
    blocks, model = surroundings(shape, seed)
    root = (model if model is not None else blocks[0]).to(device=device, dtype=dtype)
    for i, block in enumerate(blocks):
        block.attn = make_attn(i)
    return root


class ReferenceAttention(nn.Module):
    """The float64 reference attention (:func:`attnbench.correctness.reference.reference_forward`) with fixed weights."""

    def __init__(self, weights: CanonicalWeights, spec: AttnSpec):
        super().__init__()
        self.weights, self.spec = weights.to(dtype=torch.float64), spec

    def forward(self, x):
        return reference_forward(x.to(torch.float64), self.weights, self.spec.num_heads, window=self.spec.window,
                                 causal=self.spec.causal)


def attention_modules(root: nn.Module) -> list[nn.Module]:
    """The attention module of every block in ``root`` (a block or a GPT), in order."""
    return [m.attn for m in root.modules() if isinstance(m, Block)]
