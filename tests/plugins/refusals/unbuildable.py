"""A constructor attnbench cannot call: it needs a vocabulary file and a tokenizer name."""

from pathlib import Path

from torch import nn


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, vocab_file, tokenizer_name):
        super().__init__()
        self.vocab = Path(vocab_file).read_text().split()
        self.tokenizer_name = str(tokenizer_name)
