"""A convention of the tenth corpus (issue 46, round 18; our own code), alone in its module as in its repository
(whose config class lives elsewhere):

- ``UpdateAtPosition(config)``: a from-scratch Llama 3 layer: ``forward(x, kv_cache=None, start_pos=None)`` calls
  ``kv_cache.update(xk, xv, start_pos)`` with keys ``(B, S_new, H, D)``, before its heads are transposed: the third
  argument is the write position, and the keys are appended along axis 1.
"""

import torch
from torch import nn


class UpdateAtPosition(nn.Module):
    def __init__(self, config) -> None:  # its repository's config class lives in another module
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_kv_heads
        self.head_dim = config.embedding_size // self.n_heads
        self.wq = nn.Linear(config.embedding_size, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.embedding_size, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.embedding_size, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.embedding_size, bias=False)

    def forward(self, x, kv_cache=None, start_pos=None):
        b, t, _ = x.shape
        xq = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        if kv_cache is not None and start_pos is not None:
            xk, xv = kv_cache.update(xk, xv, start_pos)
        rep = self.n_heads // self.n_kv_heads
        xk, xv = (a.repeat_interleave(rep, dim=2).transpose(1, 2) for a in (xk, xv))
        scores = xq.transpose(1, 2) @ xk.transpose(2, 3) / self.head_dim ** 0.5
        total = xk.shape[2]
        hidden = torch.arange(total)[None, :] > torch.arange(total - t, total)[:, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        return self.wo((probs @ xv).transpose(1, 2).reshape(b, t, -1))
