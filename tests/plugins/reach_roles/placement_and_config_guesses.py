"""Constructors that ask for what no spec field says (issue 46, round 15; our own code):

- ``PlacedAttention(*, device: torch.device, dtype: torch.dtype, n_ctx, width, heads, init_scale)``: openai/shap-e's
  ``MultiheadAttention`` takes its device and dtype as required keywords and builds every layer with them (shap-e's is
  an encoder; this one is causal). They get the case's device and dtype.
- ``KernelTypeAttention(config)``: metavoice's ``SelfAttention`` stores ``config.attn_kernel_type`` and its forward
  runs ``if self.attn_kernel_type == "torch_attn": ... else: raise``; a second kernel (``"flash_attn"``) is compared
  first here, so the plain one must be chosen by its words, not by order.
- ``NormClassAttention(config)``: a config field that must be a class (``config.norm_class(head_dim)``); a guess cannot
  be one, and the refusal names the guessed field beside the call that failed.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class PlacedAttention(nn.Module):
    def __init__(self, *, device: torch.device, dtype: torch.dtype, n_ctx: int, width: int, heads: int,
                 init_scale: float):
        super().__init__()
        self.heads = heads
        self.c_qkv = nn.Linear(width, 3 * width, device=device, dtype=dtype)
        self.c_proj = nn.Linear(width, width, device=device, dtype=dtype)
        self.register_buffer("tril", torch.tril(torch.ones(n_ctx, n_ctx, device=device, dtype=torch.bool)))
        for layer in (self.c_qkv, self.c_proj):
            nn.init.normal_(layer.weight, std=init_scale)

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.c_qkv(x).view(b, t, self.heads, 3, -1)  # per head: its q, k and v side by side
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        w = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        w = w.masked_fill(~self.tril[:t, :t], float("-inf")).softmax(dim=-1)
        return self.c_proj((w @ v).transpose(1, 2).reshape(b, t, c))


class KernelTypeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_kernel_type = config.attn_kernel_type

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (s.view(b, t, self.n_head, -1).transpose(1, 2) for s in self.c_attn(x).split(c, dim=2))
        if self.attn_kernel_type == "flash_attn":
            raise ImportError("flash_attn is not installed")
        elif self.attn_kernel_type == "torch_attn":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            raise ValueError(f"unknown attention kernel type {self.attn_kernel_type}")
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class NormClassAttention(KernelTypeAttention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = config.norm_class(config.n_embd // config.n_head)


class NestedArgsAttention(nn.Module):
    """A config of parts (``args.model.dim``, ``args.model.n_heads``, ``args.train.attn_dropout``), as torchtitan's and
    many training scripts' are: the parts attnbench does not carry read their fields from the config itself."""

    def __init__(self, args):
        super().__init__()
        dim, self.n_heads = args.model.dim, args.model.n_heads
        self.drop = args.train.attn_dropout
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (s.view(b, t, self.n_heads, -1).transpose(1, 2) for s in self.wqkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.drop if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))
