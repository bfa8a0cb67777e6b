"""Imports a helper from its folder and calls it at import time: the failure is inside torch, the cause here."""

from refusal_helpers import build_tables
from torch import nn

TABLES = build_tables(8)


class Attention(nn.Module):
    pass
