"""A plug-in file that calls sys.exit(3) while it is imported (a script left at the bottom of a module)."""

import sys

from torch import nn


class Attention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()


sys.exit(3)
