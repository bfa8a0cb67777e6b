"""Before any case runs: resolve an implementation name, check it can run on the device, build it and map its
weights once, so a broken import, constructor or weight mapping is one line, not one failure per case.

Shared by ``attnbench check`` and the pytest plug-in (:mod:`attnbench.testing.plugin`).
"""

from __future__ import annotations

from attnbench import registry
from attnbench.correctness.cases import computes_mla
from attnbench.correctness.matrix import SHAPES
from attnbench.correctness.mla_cases import MLA_SHAPES
from attnbench.errors import UnavailableError
from attnbench.plugins import preflight


def available(name: str, device: str) -> registry.Implementation:
    """The implementation called ``name``; :class:`UnavailableError` when it cannot run on ``device`` here."""
    impl = registry.get(name)  # an unknown name or a plug-in that does not import fails here
    reason = impl.unavailable_reason(device)
    if reason:
        raise UnavailableError(f"{name} cannot run on {device} here: {reason}; choose another --device or implementation")
    return impl


def prepared(impl: registry.Implementation, device: str) -> list[str]:
    """Construct ``impl`` and map its weights once (raises the setup error); the lines ``check -v`` prints."""
    shapes = MLA_SHAPES if computes_mla(impl) else SHAPES  # issue 46: an MLA built-in builds for MLA specs only
    return preflight(impl, device, other_specs=[shape.spec for shape in shapes])
