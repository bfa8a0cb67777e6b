"""A local-attention layer whose window is a required keyword (lucidrains' ``LocalMHA(*, dim, window_size, ...)``):
the constructor divides it (``window_size // 2``), so ``None`` cannot be passed. With no window in the spec, a window
over every position is full causal attention: the binder passes the context length (and ``-v`` says so)."""

import math

import torch
from torch import nn


class RequiredWindowLocal(nn.Module):
    def __init__(self, *, dim, window_size, dim_head=64, heads=8, dropout=0.0, causal=False):
        super().__init__()
        self.heads, self.dim_head, self.causal = heads, dim_head, causal
        self.window_size, self.look_back = window_size, window_size // 2  # the constructor uses the window
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.dim_head).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        sim = (q @ k.transpose(-2, -1)) / math.sqrt(self.dim_head)
        i = torch.arange(n, device=x.device)
        hide = (i[None, :] <= i[:, None] - self.window_size)  # keys a whole window or more behind
        if self.causal:
            hide = hide | (i[None, :] > i[:, None])
        sim = sim.masked_fill(hide, float("-inf"))
        out = self.dropout(sim.softmax(dim=-1)) @ v
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))
