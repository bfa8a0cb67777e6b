"""Implementations that misbehave at run time, for the sweep's fault handling (book constructor and names)."""

import os
import signal
import time

import torch
from torch import nn


class _Base(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.out_proj(self.W_value(x))  # not attention: these classes are about failures


class Raises(_Base):
    """Raises in forward."""

    def forward(self, x):
        raise RuntimeError("deliberate failure in forward")


class ImpossibleAllocation(_Base):
    """Asks the allocator for far more memory than any machine has: a real out-of-memory."""

    def forward(self, x):
        return torch.empty(2**46, dtype=torch.float32, device=x.device)


class Hangs(_Base):
    """Never returns (a Python-level hang)."""

    def forward(self, x):
        while True:
            time.sleep(0.05)


class ReturnsNaN(_Base):
    """Right shape, non-finite values."""

    def forward(self, x):
        return super().forward(x) * float("nan")


class WrongShape(_Base):
    """Drops the last token."""

    def forward(self, x):
        return super().forward(x)[:, :-1]


class Segfaults(_Base):
    """Kills its own process with SIGSEGV, as a crashing native extension would."""

    def forward(self, x):
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(5)


class SlowAfterFirstCall(_Base):
    """With ATTNBENCH_TEST_SLOW=1, sleeps in every call after the first: slow enough to interrupt mid-sweep."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        if type(self).calls > 1 and os.environ.get("ATTNBENCH_TEST_SLOW") == "1":
            time.sleep(0.1)
        return super().forward(x)


class ExitsProcess(_Base):
    """Ends the process from forward, with status 0: a check must not read that as a pass."""

    def forward(self, x):
        os._exit(0)


class SysExits(_Base):
    """Calls sys.exit(4) from forward."""

    def forward(self, x):
        import sys

        sys.exit(4)


class HangsAWhile(_Base):
    """Does not return for two minutes (a Python-level hang, bounded so that a test that fails to time it out does not
    leave it running), then raises."""

    def forward(self, x):
        end = time.monotonic() + 120.0
        while time.monotonic() < end:
            time.sleep(0.05)
        raise RuntimeError("HangsAWhile gave up after 120 s (the test meant to time it out did not)")


class KilledInForward(_Base):
    """SIGKILLs its own process, as the kernel's OOM killer (or a person) would."""

    def forward(self, x):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)


class SwallowsTimeouts(_Base):
    """Hangs in forward, swallows the first exception raised while it waits (as a probe's ``except Exception`` that
    tries the next guess does), then hangs again; bounded to two minutes."""

    def forward(self, x):
        end = time.monotonic() + 120.0
        try:
            while time.monotonic() < end:
                time.sleep(0.05)
        except Exception:  # noqa: S110 - the point of this class
            pass
        while time.monotonic() < end:
            time.sleep(0.05)
        raise RuntimeError("SwallowsTimeouts gave up after 120 s (the test meant to time it out did not)")


class HangsInConstructor(_Base):
    """Does not return from ``__init__`` for two minutes (bounded like :class:`HangsAWhile`), then raises."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        end = time.monotonic() + 120.0
        while time.monotonic() < end:
            time.sleep(0.05)  # HANGS HERE
        raise RuntimeError("HangsInConstructor gave up after 120 s (the test meant to stop it did not)")
