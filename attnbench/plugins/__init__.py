"""Bring your own attention: how a user's class, as written, becomes an attnbench implementation.

* :mod:`~attnbench.plugins.loading` imports ``path/to/file.py`` as ``python file.py`` would and reads
  ``NAME=target`` display names;
* :mod:`~attnbench.plugins.binding` calls the constructor with the spec by parameter name (with the
  aliases common codebases use), or with a config object, and reads ``attnbench_capabilities``;
* :mod:`~attnbench.plugins.configs` fills a config parameter with the class's own config dataclass
  (gpt-fast's ``ModelArgs``, nanochat's ``GPTConfig``, litgpt's ``Config``), its fields mapped by meaning;
* :mod:`~attnbench.plugins.module_cache` installs a cache object on a class that reads ``self.kv_cache``
  (gpt-fast, litgpt-style), and documents the ``attnbench_cache_attr`` protocol;
* :mod:`~attnbench.plugins.layout` finds where the canonical weights live in the built module (separate,
  fused, per-head or ``nn.MultiheadAttention`` projections) and turns that into an
  :class:`~attnbench.weights.Adapter`, so most classes need no hand-written glue;
* :mod:`~attnbench.plugins.inference` reads what a class computes (KV cache, GQA/MQA, sliding window,
  non-causal) from its signatures, config fields and projection shapes, with the evidence for ``check -v``;
* :mod:`~attnbench.plugins.cache_state` snapshots and restores a module's KV-cache state, so a class without
  ``rewind_cache`` can be timed in decode mode.
"""

from attnbench.plugins.inference import implementation_fields
from attnbench.plugins.layout import preflight
from attnbench.plugins.loading import import_file, split_display_name

__all__ = ["implementation_fields", "import_file", "preflight", "split_display_name"]
