"""Implementations that pass their first call and fail later, while timed with others (book constructor and names)."""

import time

from torch import nn


class _Base(nn.Module):
    fail_after = 40  # calls: past the first call and the warm-up, inside the timed bursts

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.fail_after:
            self.fail()
        return self.out_proj(self.W_value(x))  # not attention: these classes are about failures

    def fail(self):
        raise NotImplementedError


class RaisesLater(_Base):
    """Raises once it is being timed."""

    def fail(self):
        raise RuntimeError("deliberate failure while timed")


class HangsLater(_Base):
    """Never returns once it is being timed (a Python-level hang)."""

    def fail(self):
        while True:
            time.sleep(0.05)


class AbortsLater(_Base):
    """Kills its own process (SIGABRT) once it is being timed, as a crashing native extension would."""

    def fail(self):
        import os

        os.abort()
