"""Built-in implementations, imported as ``attnbench.implementations`` (one module per family).

Importing this package registers every built-in with :mod:`attnbench.registry`. The folder is mapped
into the ``attnbench`` namespace by ``pyproject.toml`` so it can never collide with another
top-level package called ``implementations`` in a user's environment.
"""

from attnbench.implementations import (  # noqa: F401
    book,
    flex,
    fused,
    gqa,
    hf,
    kv_cache,
    masked,
    mla_deepseek,
    paged,
    per_head_linear,
    rope,
    sdpa,
    torch_mha,
    varlen,
)
