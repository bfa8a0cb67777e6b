"""A module-level assert without a message, written over two lines."""

from torch import nn

HEADS, WIDTH = 3, 64
assert WIDTH % HEADS == 0 and \
    HEADS > 0


class Attention(nn.Module):
    pass
