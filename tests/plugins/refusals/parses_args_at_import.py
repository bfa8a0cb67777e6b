"""Reproduces SakanaAI/AI-Scientist's ``templates/nanoGPT/experiment.py``: the training script parses its command line
at import (``argparse``, every option with a default), harmless as ``python experiment.py`` runs it with no extra
arguments. Imported with attnbench's own arguments in ``sys.argv`` it would exit 2 on them; it is imported as
``python file.py`` alone. Our own code, written for attnbench's tests."""
import argparse

import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--out_dir", type=str, default="run_0")
args = parser.parse_args()


class ParsedArgsAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
