"""min-dalle's convention (issue 46, round 20), reproduced in our own code: a module whose import turns gradients off
for the whole process (an inference package's ``torch.set_grad_enabled(False)``, reached by importing its model
modules through the package's ``__init__``), and an encoder self-attention that scales its queries in place, takes a
required ``(B, 1, 1, T)`` bool keep-mask and turns it into an additive ``-1e12`` bias, with einsum over ``b q h c``."""

import torch
from torch import nn

torch.set_grad_enabled(False)


class KeysValuesQueries(nn.Module):
    def __init__(self, head_count: int, embed_count: int):
        super().__init__()
        self.head_count, self.embed_count = head_count, embed_count
        self.k_proj = nn.Linear(embed_count, embed_count, bias=False)
        self.v_proj = nn.Linear(embed_count, embed_count, bias=False)
        self.q_proj = nn.Linear(embed_count, embed_count, bias=False)
        self.out_proj = nn.Linear(embed_count, embed_count, bias=False)

    def attend(self, keys, values, queries, attention_mask):
        keys, values, queries = (t.reshape(t.shape[:2] + (self.head_count, -1)) for t in (keys, values, queries))
        queries /= queries.shape[-1] ** 0.5
        weights = torch.einsum("bqhc,bkhc->bhqk", queries, keys)
        weights += (1 - attention_mask.to(torch.float32)) * -1e12  # in place: the scores keep their dtype
        out = torch.einsum("bhqk,bkhc->bqhc", torch.softmax(weights, -1), values)
        return self.out_proj(out.reshape(out.shape[:2] + (self.embed_count,)))


class GradOffAtImport(KeysValuesQueries):
    def forward(self, encoder_state, attention_mask):
        return self.attend(self.k_proj(encoder_state), self.v_proj(encoder_state), self.q_proj(encoder_state),
                           attention_mask)
