"""``from .rotary import ...`` in a folder without ``__init__.py`` (ashworks' ``llama3/attention.py``): imported as
``folder.module``, a namespace package, when the relative import fails as a script (our own code)."""
import math

import torch
from torch import nn

from .rotary import causal_hidden


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.nh = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.nh, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(causal_hidden(T), float("-inf"))
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


_ = torch
