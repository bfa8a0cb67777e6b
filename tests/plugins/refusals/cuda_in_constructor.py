"""A constructor that checks its sizes, then makes its mask on the GPU (``device="cuda"``), as training code written
for one machine does: assignments of the wrong sizes stop at the check, the right one at CUDA. Our own code, written
for attnbench's tests."""
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, span, lanes, window):
        super().__init__()
        assert span % lanes == 0 and span // lanes >= 2, "span must split into lanes"
        self.lanes = lanes
        self.qkv = nn.Linear(span, 3 * span)
        self.out = nn.Linear(span, span)
        self.register_buffer("hidden", torch.ones(window, window, device="cuda").triu(1).bool())

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.lanes, -1).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        s = s.masked_fill(self.hidden[:t, :t], float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))
