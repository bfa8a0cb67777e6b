"""Helpers the attention module imports by absolute name (as nanochat's gpt.py imports nanochat.common)."""

import torch

COMPUTE_DTYPE = torch.float32


def rms(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.size(-1),))
