"""A planted regression for the instruction-count gate (docs/instructions.md): the book's weight-split attention
with about 1% more work per call.

``PlantedWeightSplit`` computes exactly what ``weight_split`` computes, then makes one extra elementwise pass
(a multiplication by 1) over the first ``PLANTED_COLUMNS`` (160 of 256) output features: the output is unchanged, the work is not.
Load it under weight_split's name so that ``attnbench compare`` matches it with the unchanged cell::

    attnbench run --metric instructions --impl weight_split=examples/planted_regression.py:PlantedWeightSplit ...
"""

from __future__ import annotations

from attnbench.implementations.book import MultiHeadAttention

PLANTED_COLUMNS = 160


class PlantedWeightSplit(MultiHeadAttention):
    """weight_split plus one elementwise pass over part of its output (same result, more instructions)."""

    def forward(self, x):
        out = super().forward(x)
        out[..., :PLANTED_COLUMNS].mul_(1.0)
        return out
