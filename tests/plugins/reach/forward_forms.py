"""Forward-level conventions of model code that attnbench binds by name (issue 36, item 3), each in a class of its own:

* ``FlagAttention``: ``forward(x, attn_mask=None, is_causal=False)`` handing both to SDPA, which refuses the two
  together (timm-, x-transformers- and many training repositories' style);
* ``FlagDefaultTrue``: the same with the flag on by default (a mask beside it must come with ``is_causal=False``);
* ``IgnoresFlag``: takes ``is_causal`` but masks only through its mask (the flag is dead code): the mask must be passed;
* ``MatrixRope``: ``forward(x, freq_cis)`` with each frequency's rotation as a ``(T, head_dim/2, 2, 2)`` matrix
  ``[[cos, -sin], [sin, cos]]`` applied to interleaved pairs (``freq_cis``: the spelling some ports use).
"""

from torch import nn
from torch.nn import functional as F


class _Heads(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def qkv(self, x):
        b, t, _ = x.shape
        return [w(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                for w in (self.W_query, self.W_key, self.W_value)]

    def out(self, y):
        b, h, t, d = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, t, h * d))


class FlagAttention(_Heads):
    def forward(self, x, attn_mask=None, is_causal=False):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal))


class FlagDefaultTrue(_Heads):
    def forward(self, x, attn_mask=None, is_causal=True):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal))


class IgnoresFlag(_Heads):
    def forward(self, x, mask=None, is_causal=False):
        q, k, v = self.qkv(x)
        if mask is not None:
            mask = ~mask  # the book's form: True = hidden
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def rotate_by_matrices(x, freq_cis):
    """Interleaved pairs ``(2j, 2j + 1)`` of ``x`` ``(B, H, T, D)`` turned by ``freq_cis`` ``(T, D/2, 2, 2)``."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, H, T, D/2, 2)
    turned = (freq_cis.to(pairs.dtype)[None, None] @ pairs[..., None])[..., 0]
    return turned.flatten(-2).type_as(x)


class MatrixRope(_Heads):
    def forward(self, x, freq_cis):
        q, k, v = self.qkv(x)
        q, k = rotate_by_matrices(q, freq_cis), rotate_by_matrices(k, freq_cis)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
