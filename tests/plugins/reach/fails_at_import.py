"""A module whose import fails with a multi-line message (a device assert at import time)."""

from torch import nn

raise RuntimeError("this module needs a GPU at import time\nsecond line of the message\nthird line")


class Attention(nn.Module):
    pass
