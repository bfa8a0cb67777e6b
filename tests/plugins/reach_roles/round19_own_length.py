"""A convention of code written from scratch (issue 46, round 19; our own code): the causal mask is sized by a
module constant, not by anything the constructor takes, so the class raises on a longer sequence. That is its own
limit, measured (``plugins/own_length.py``), and the cases with a longer context are skipped.

- ``GlobalBlockSize(n_embd, n_head)``: nanoGPT's ``bias = tril(ones(block_size, block_size))`` buffer with a
  module-level ``block_size = 64`` (the tutorials' ``block_size = 256`` above their ``Head``).
- ``UnboundedLength``: the same with the mask made in the forward: no limit, nothing inferred.
"""

import torch
from torch import nn
from torch.nn import functional as F

block_size = 64


class GlobalBlockSize(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def mask(self, T):
        return self.bias[:, :, :T, :T] == 0

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = F.softmax(att.masked_fill(self.mask(T), float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class UnboundedLength(GlobalBlockSize):
    def mask(self, T):
        return torch.ones(T, T, dtype=torch.bool, device=self.bias.device).triu(1)
