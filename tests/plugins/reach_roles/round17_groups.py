"""``DerivedGroups(config)``: see ``round17_conventions.py`` (our own code)."""

from torch import nn
from torch.nn import functional as F


class DerivedGroups(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.n_kv_groups, self.d_k = config.n_kv_groups, config.d_k
        self.q_proj = nn.Linear(config.d_model, self.n_heads * self.d_k, bias=False)
        self.k_proj = nn.Linear(config.d_model, self.n_kv_heads * self.d_k, bias=False)
        self.v_proj = nn.Linear(config.d_model, self.n_kv_heads * self.d_k, bias=False)
        self.w_o = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.d_k).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.d_k).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.d_k).transpose(1, 2)
        k, v = (t.repeat_interleave(self.n_kv_groups, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.w_o(y.transpose(1, 2).reshape(B, T, -1))
