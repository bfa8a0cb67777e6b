"""Bring your own attention: how a user's class, as written, becomes an attnbench implementation.

* :mod:`~attnbench.plugins.loading` imports ``path/to/file.py`` as ``python file.py`` would and reads
  ``NAME=target`` display names;
* :mod:`~attnbench.plugins.binding` calls the constructor with the spec by parameter name (with the
  aliases common codebases use), or with a config object, and reads ``attnbench_capabilities``;
* :mod:`~attnbench.plugins.layout` finds where the canonical weights live in the built module (separate,
  fused, per-head or ``nn.MultiheadAttention`` projections) and turns that into an
  :class:`~attnbench.weights.Adapter`, so most classes need no hand-written glue.
"""

from attnbench.plugins.binding import implementation_fields
from attnbench.plugins.layout import preflight
from attnbench.plugins.loading import import_file, split_display_name

__all__ = ["implementation_fields", "import_file", "preflight", "split_display_name"]
