"""A constructor that fails on an installed library's object: the class was written for another version of it.

EAGLE's ``Qwen2Attention(config: Qwen2Config)`` reads ``config.rope_theta``, which transformers 5 moved into
``rope_parameters``: built with its own config type it raises ``AttributeError: 'Qwen2Config' object has no attribute
'rope_theta'``, and with attnbench's config it raises inside transformers (``ROPE_INIT_FUNCTIONS['default']``, gone in
5). Either is a symptom; the cause a user can act on is the library's version. :func:`written_for_another` says so
when the exception is an ``AttributeError`` on an object of an installed distribution's type.
"""

from __future__ import annotations

import importlib.metadata


def _distribution(module_name: str) -> tuple[str, str] | None:
    """``(distribution, version)`` that provides the top-level package of ``module_name``, or ``None`` (the user's
    own code, or the standard library)."""
    top = module_name.split(".")[0]
    if top in ("builtins", "attnbench", "torch", "__main__"):
        return None
    names = importlib.metadata.packages_distributions().get(top)
    if not names:
        return None
    try:
        return names[0], importlib.metadata.version(names[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def written_for_another(exc: BaseException) -> str | None:
    """``"it reads Qwen2Config.rope_theta, which transformers 5.25.0 does not have: ..."``
    when ``exc`` is an ``AttributeError`` on an installed library's object; ``None`` otherwise."""
    if not isinstance(exc, AttributeError) or getattr(exc, "obj", None) is None or not getattr(exc, "name", None):
        return None
    kind = type(exc.obj)
    found = _distribution(kind.__module__)
    if found is None:
        return None
    dist, version = found
    return (f"it reads {kind.__name__}.{exc.name}, which {dist} {version}'s {kind.__name__} does not have: written for "
            f"another version of {dist}, or a field the class expects set by hand")
