"""A module that warns when it is imported (a deprecation, torch's own ``UserWarning`` about an option), holding a
whole block rather than an attention layer. Our own code, written for attnbench's tests."""
import warnings

from torch import nn

warnings.warn("this module's layers are deprecated; use layers_v2", UserWarning, stacklevel=1)


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))
