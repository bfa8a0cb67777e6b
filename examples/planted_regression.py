"""A planted regression for the instruction-count gate (docs/instructions.md): the book's weight-split attention
with about 1% more work per call.

``PlantedWeightSplit`` computes exactly what ``weight_split`` computes, then makes ``PLANTED_PASSES`` extra elementwise
passes (multiplications by 1) over the first ``PLANTED_COLUMNS`` output features: the output is unchanged, the work
is not. For the evidence's cell (batch 1, 128 tokens, 4 heads, d_model 256, inference) that is about 1.4% more
instructions per call: most of it is each operation's dispatch, not the elements (AVX2 multiplies 8 at a time).
Load it under weight_split's name so that ``attnbench compare`` matches it with the unchanged cell::

    attnbench run --metric instructions --impl weight_split=examples/planted_regression.py:PlantedWeightSplit ...
"""

from __future__ import annotations

from attnbench.implementations.book import MultiHeadAttention

PLANTED_COLUMNS = 160
PLANTED_PASSES = 3


class PlantedWeightSplit(MultiHeadAttention):
    """weight_split plus a few elementwise passes over part of its output (same result, more instructions)."""

    def forward(self, x):
        out = super().forward(x)
        for _ in range(PLANTED_PASSES):
            out[..., :PLANTED_COLUMNS].mul_(1.0)
        return out


class PlantedOnePass(PlantedWeightSplit):
    """weight_split plus one elementwise pass over part of its output: a third of ``PlantedWeightSplit``'s extra work
    (below the +0.5% the noise threshold must catch)."""

    def forward(self, x):
        out = MultiHeadAttention.forward(self, x)
        out[..., :PLANTED_COLUMNS].mul_(1.0)
        return out
