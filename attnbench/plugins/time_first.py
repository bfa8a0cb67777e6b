"""Time-first attention layers: a forward that takes ``(T, B, C)`` (fairseq's ``MultiheadAttention``) (issue 46).

fairseq's ``MultiheadAttention`` and the many classes that copy it (ESM, BART and wav2vec ports, Uni-Mol, OFA, ...)
read ``tgt_len, bsz, embed_dim = query.size()``: time first, batch second, as ``nn.MultiheadAttention`` without
``batch_first``. Given ``(B, T, C)`` such a class attends over the batch, and no mask form of ``(T, T)`` fits its
scores. When no mask form runs as given, the class is probed again with its sequence inputs transposed: every 3-D
tensor argument whose last axis is the model width is passed ``(T, B, C)`` and its output (or the first element of a
tuple) read back as ``(B, T, C)``, by a subclass made for the instance whose forward calls the class's (its code is
unchanged). When that binds, the class is checked so, and ``check -v`` says so.
"""

from __future__ import annotations

from torch import nn

from attnbench.plugins.channels_first import transposed_io

NOTE = ("time first: its forward takes (T, B, C) (tgt_len, bsz, embed_dim = query.size(), fairseq's layout), decided "
        "by a probe (given (B, T, C) no mask form ran); its inputs are given transposed and its output read back as "
        "(B, T, C)")


def as_batch_first(module: nn.Module, width: int) -> nn.Module:
    """``module`` taking ``(B, T, C)`` inputs: every 3-D tensor argument whose last axis is ``width`` is passed as
    ``(T, B, C)``, a 3-D output (or a tuple's first element) is returned ``(B, T, C)``."""
    return transposed_io(module, width, (0, 1), "attnbench_time_first")
