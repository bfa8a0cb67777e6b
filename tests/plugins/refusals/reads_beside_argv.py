"""Reproduces KellerJordan/modded-nanogpt ``train_gpt.py``: at import the script reads its own source through
``sys.argv[0]`` (for logging), as ``python train_gpt.py`` runs it. Our own code, written for attnbench's tests."""
import sys

import torch.nn.functional as F
from torch import nn

with open(sys.argv[0]) as f:
    CODE = f.read()
assert "class ArgvAttention" in CODE, "sys.argv[0] is not this file"


class ArgvAttention(nn.Module):
    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
