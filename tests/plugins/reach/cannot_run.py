"""Constructors that cannot run on a CPU machine in one process, as Meta's llama3 ``Attention``: a model-parallel
group nobody initialised (fairscale asserts), and a cache moved to CUDA in ``__init__``."""

from dataclasses import dataclass

import torch
from torch import nn

_GROUP = None


def get_model_parallel_world_size() -> int:
    assert _GROUP is not None, "model parallel group is not initialized"
    return 1


@dataclass
class ModelArgs:
    dim: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = None
    max_batch_size: int = 32
    max_seq_len: int = 2048


class ModelParallelAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_local_heads = args.n_heads // get_model_parallel_world_size()
        self.wq = nn.Linear(args.dim, args.dim, bias=False)


class CudaCacheAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        head_dim = args.dim // args.n_heads
        self.cache_k = torch.zeros((args.max_batch_size, args.max_seq_len, args.n_heads, head_dim)).cuda()
