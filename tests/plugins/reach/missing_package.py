"""A module that imports an optional package this machine does not have."""

import attnbench_reach_absent_package  # noqa: F401
from torch import nn


class Attention(nn.Module):
    pass
