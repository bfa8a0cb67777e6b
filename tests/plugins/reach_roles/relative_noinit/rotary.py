"""A helper beside ``attention.py`` in a folder without ``__init__.py`` (our own code)."""
import torch


def causal_hidden(T):
    return torch.ones(T, T, dtype=torch.bool).triu(1)
