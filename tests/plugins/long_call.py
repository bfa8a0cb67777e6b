"""A layer whose every call is long (a sleep), for the long-call stopping rule (issue 39, item 5): tests shrink
``LONG_CALL_S`` below its call so that it is judged as a 90-second generation would be."""

import time

from torch import nn


class SleepsPerCall(nn.Module):
    seconds = 0.06

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.out_proj(self.W_value(x))  # not attention: this class is about its call time
