"""Width under an unknown name, causality switched on by the mere presence of a mask.

Reproduces the convention of openai/whisper ``whisper/model.py:MultiHeadAttention`` (commit c0d2f62): the
constructor takes two plain ints, the model width as ``n_state`` and the head count as ``n_head``; ``forward(x, xa=None,
mask=None, kv_cache=None)`` where any non-None ``mask`` turns the causal triangle on (its values are not read), ``xa``
is a cross-attention input, ``kv_cache`` a dict keyed by the key/value projection modules; the key projection has no
bias; it returns ``(out, None)``. Our own code, written for attnbench's tests.
"""
import torch.nn.functional as F
from torch import nn


class StateWidthAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def _heads(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.n_head, -1).transpose(1, 2)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        source = x if xa is None else xa
        if kv_cache is not None and xa is not None and self.key in kv_cache:
            k, v = kv_cache[self.key], kv_cache[self.value]
        else:
            k, v = self.key(source), self.value(source)
        q, k, v = self._heads(self.query(x)), self._heads(k), self._heads(v)
        causal = mask is not None and x.shape[1] > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(1, 2).flatten(2)), None
