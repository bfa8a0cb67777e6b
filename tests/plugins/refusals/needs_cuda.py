"""A training script's layer that asserts CUDA while it is imported."""

import torch
from torch import nn

assert torch.cuda.is_available()


class Attention(nn.Module):
    pass
