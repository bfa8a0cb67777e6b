"""A layer whose projections are given to its constructor (dependency injection, as in torchtune's
``MultiHeadAttention(embed_dim, num_heads, num_kv_heads, head_dim, q_proj, k_proj, v_proj, output_proj)``): attnbench
builds each projection from the spec."""

from torch import nn
from torch.nn import functional as F


class InjectedAttention(nn.Module):
    def __init__(self, *, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, q_proj: nn.Module,
                 k_proj: nn.Module, v_proj: nn.Module, output_proj: nn.Module, is_causal: bool = True):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.is_causal = num_heads, num_kv_heads, head_dim, is_causal
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = q_proj, k_proj, v_proj, output_proj

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        return self.output_proj(y.transpose(1, 2).reshape(b, t, -1))
