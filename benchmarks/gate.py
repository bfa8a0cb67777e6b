"""The asv regression gate: ``python benchmarks/gate.py BASE HEAD [--factor 1.2] [--bench REGEX]``.

Exits 1 when HEAD is significantly slower than BASE beyond the factor, 2 when the gate cannot run.
The logic lives in :mod:`attnbench.tools.asv_gate` (also ``attnbench asv-compare BASE HEAD``). asv imports
every module of this folder when it discovers benchmarks, so nothing happens here at import (and
the commit under test may predate ``attnbench.tools.asv_gate``).
"""

if __name__ == "__main__":
    import sys

    from attnbench.tools.asv_gate import main

    sys.exit(main())
