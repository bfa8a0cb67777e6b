"""Importing plug-in files, and the ``NAME=target`` form that gives an implementation a short display name."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from attnbench.errors import PluginLoadError
from attnbench.plugins.exits import PluginExit, plugin_exits

_DISPLAY = re.compile(r"^([A-Za-z0-9_.+-]+)=(.+)$")


def split_display_name(name: str) -> tuple[str | None, str]:
    """``"mine=path/to/file.py:Class"`` -> ``("mine", "path/to/file.py:Class")``; other names -> ``(None, name)``."""
    match = _DISPLAY.match(name.strip())
    if not match:
        return None, name.strip()
    return match.group(1), match.group(2).strip()


def import_file(path_text: str) -> ModuleType:
    """Import ``path_text`` as ``python path_text`` would: its folder first on ``sys.path`` while it is imported.

    The module gets a private name (one per resolved path), so two plug-in files with the same file
    name never replace each other; modules the file imports from its folder are imported normally.
    """
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise PluginLoadError(f"plug-in file {path_text!r} does not exist (resolved to {path.resolve()}); "
                              "check the path, which is relative to the current directory")
    resolved = path.resolve()
    mod_name = f"attnbench_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise PluginLoadError(f"cannot import {path_text!r} as Python; it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    folder = str(resolved.parent)
    sys.path.insert(0, folder)
    try:
        with plugin_exits(f"importing plug-in {path_text!r}"):
            spec.loader.exec_module(module)
    except PluginExit as exc:
        del sys.modules[mod_name]
        raise PluginLoadError(str(exc)) from None
    except Exception as exc:
        del sys.modules[mod_name]
        raise PluginLoadError(f"importing plug-in {path_text!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above
    return module
