"""A plug-in whose forward does not return (a Python-level hang: a sleep loop, bounded so a broken test cannot leave it
running for long), with the book's constructor and attribute names."""

import time

from torch import nn

HANG_S = 120.0


class Hangs(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            time.sleep(0.05)
        raise RuntimeError(f"Hangs gave up after {HANG_S:g} s (the test meant to time it out did not)")
