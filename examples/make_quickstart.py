"""Writes examples/quickstart.ipynb (kept as source here so the notebook's cells are reviewable as Python).

Run ``python examples/make_quickstart.py`` after editing the cells; the slow test set executes the notebook.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("# attnbench quickstart\n\nCheck an attention class written in this notebook against the "
                      "float64 reference, then time it against `sdpa` and `weight_split` and look at the speed-ups. "
                      "Tiny sizes: it runs in about a minute on a laptop CPU."),
    new_code_cell('''import torch
from torch import nn

import attnbench


class MyAttention(nn.Module):
    """Causal multi-head attention with the book's constructor and projection names."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1).bool())

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for w in (self.W_query, self.W_key, self.W_value))
        scores = (q @ k.transpose(2, 3)).masked_fill(self.mask[:t, :t], -torch.inf)
        weights = self.dropout(torch.softmax(scores / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, -1))


attnbench.register("mine", MyAttention)'''),
    new_markdown_cell("## Is it correct?\n\nThe correctness matrix: every case against a float64 reference "
                      "(`attnbench check mine` in a terminal, `pytest --attnbench ...` in a test suite)."),
    new_code_cell('check = attnbench.check(["mine"])\ncheck'),
    new_markdown_cell("## How fast is it?\n\nA tiny sweep; `results` is a DataFrame that shows the run's summary."),
    new_code_cell('''results = attnbench.run(impl=["mine", "sdpa", "weight_split"], seq_len=[16, 32], d_model=[32], num_heads=[2],
                        batch=[1], mode=["forward"], out="runs",
                        settings={"baseline": "weight_split", "budget_s": 0.05, "warmup_s": 0.0, "min_samples": 3,
                                  "flop_check": False})
results'''),
    new_code_cell('results.plot("heatmap")'),
    new_markdown_cell("The whole report (every figure and table) as one HTML page:"),
    new_code_cell("results.report()"),
]

if __name__ == "__main__":
    nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, Path(__file__).with_name("quickstart.ipynb"))
