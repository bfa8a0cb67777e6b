"""``F.scaled_dot_product_attention``: PyTorch's dispatcher, each backend forced, and an explicit mask.

Projections use the book's attribute names, so the canonical weights load without an adapter.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnbench.implementations._common import AttentionModule, add_book_projections, merge_heads, split_heads
from attnbench.plugins.catalog import register

API = "torch.nn.functional.scaled_dot_product_attention"
BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


class SDPAttention(AttentionModule):
    """Book projections + F.scaled_dot_product_attention(is_causal=causal); optionally one backend forced."""

    backend: SDPBackend | None = None
    explicit_mask = False

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, causal=True):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias, causal=causal)
        add_book_projections(self, d_in, d_out, qkv_bias)
        self.dropout_p = dropout
        if self.explicit_mask:  # True = may attend (SDPA's meaning, the opposite of masked_fill's)
            self.register_buffer("allowed", torch.ones(context_length, context_length, dtype=torch.bool).tril(),
                                 persistent=False)

    def _attend(self, q, k, v):
        p = self.dropout_p if self.training else 0.0
        if self.explicit_mask:
            T = q.shape[-2]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed[:T, :T], dropout_p=p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)  # (b, nh, T, hd)

    def forward(self, x):
        self.check_input(x)
        q = split_heads(self.W_query(x), self.num_heads)  # (b, nh, T, hd)
        k = split_heads(self.W_key(x), self.num_heads)
        v = split_heads(self.W_value(x), self.num_heads)
        if self.backend is None:
            context = self._attend(q, k, v)
        else:
            with sdpa_kernel(self.backend):
                context = self._attend(q, k, v)
        return self.out_proj(merge_heads(context))  # (b, T, d_out)


@functools.cache
def _backend_probe(backend: SDPBackend, device_type: str, index: int | None) -> str | None:
    """Run a tiny causal SDPA call with only ``backend`` enabled; the reason it fails, or None."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if device_type == "cpu" else [torch.float16, torch.bfloat16, torch.float32]
    errors = []
    for dtype in dtypes:
        q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True)
            return None
        except RuntimeError as exc:
            errors.append(f"{str(dtype).removeprefix('torch.')}: {str(exc).splitlines()[0][:80]}")
    return f"backend {backend.name} has no kernel for {device_type} in this torch build ({'; '.join(errors[:1])})"


def _probe_for(backend: SDPBackend):
    def probe(device: torch.device) -> str | None:
        return _backend_probe(backend, device.type, device.index)

    return probe


# non_causal: is_causal=False (PyTorch's CPU flash-attention RFC measures both; preset cpu-flash-rfc)
register("sdpa", SDPAttention, source=f"{API} (is_causal=True, dispatcher picks the backend)",
         description="F.scaled_dot_product_attention(is_causal=True); PyTorch picks the kernel", non_causal=True)
for _name, _backend in BACKENDS.items():
    _cls = type(f"SDPAttention_{_name}", (SDPAttention,), {"backend": _backend, "__module__": __name__})
    globals()[_cls.__name__] = _cls
    register(f"sdpa_{_name}", _cls, source=f"{API} under torch.nn.attention.sdpa_kernel({_backend.name})",
             description=f"F.scaled_dot_product_attention forced to the {_name} backend",
             probe=_probe_for(_backend), devices=("cpu", "cuda") if _name in ("math", "flash") else ("cuda",),
             dropout=("cuda",) if _name == "flash" else True,  # the CPU flash kernel has no dropout
             sdpa_backend=None if _name == "math" else _name,  # on CUDA, PyTorch's own check decides per cell
             non_causal=True)


class SDPAttentionMask(SDPAttention):
    """F.scaled_dot_product_attention with an explicit boolean causal mask (True = may attend); causal only."""

    explicit_mask = True

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)


register("sdpa_mask", SDPAttentionMask, source=f"{API} (attn_mask=tril bool, the custom-mask path)")
