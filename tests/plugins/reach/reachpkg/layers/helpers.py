"""Imported relatively (``from .helpers import ...``) by the attention module."""

from torch import nn


class Linear(nn.Linear):
    """A Linear that casts its weight to the input's dtype (as nanochat's does)."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight.to(dtype=x.dtype))
