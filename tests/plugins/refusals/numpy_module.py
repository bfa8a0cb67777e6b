"""A NumPy model's attention (our own code, in the style of a from-scratch NumPy GPT): a ``Module`` of its own, not
``torch.nn.Module``, whose constructor takes an ``np.random.Generator``. Its first true cause is that it is no torch
module, not that attnbench cannot choose a generator."""

import numpy as np


class Module:
    def parameters(self):
        return [v for v in vars(self).values() if isinstance(v, np.ndarray)]


class CausalSelfAttention(Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, rng: np.random.Generator) -> None:
        self.n_head = n_head
        self.w_qkv = rng.standard_normal((n_embd, 3 * n_embd)) * 0.02
        self.w_o = rng.standard_normal((n_embd, n_embd)) * 0.02
        self.mask = np.tril(np.ones((block_size, block_size), dtype=bool))
