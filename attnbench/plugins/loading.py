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


def package_of(path: Path) -> tuple[Path, str] | None:
    """``(root, "pkg.sub.module")`` when ``path`` sits in a package (folders with ``__init__.py`` above it): the
    dotted name Python imports it under with ``root`` on ``sys.path``; ``None`` for a loose script."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.insert(0, folder.name)
        folder = folder.parent
    return (folder, ".".join(parts)) if len(parts) > 1 else None


def how_imported(path_text: str) -> str:
    """One line for ``check -v``: the module name and ``sys.path`` entry a plug-in file is imported with."""
    resolved = Path(path_text).expanduser().resolve()
    package = package_of(resolved)
    if package is None:
        return f"imported {resolved.name} as a script, its folder {resolved.parent} first on sys.path"
    root, dotted = package
    return f"imported {resolved.name} as {dotted} (it is in a package), with the package root {root} on sys.path"


IMPORTED: dict[str, str] = {}
"""Module name -> how its plug-in file was imported (:func:`how_imported`), for ``check -v``."""


def import_file(path_text: str) -> ModuleType:
    """Import ``path_text`` as Python would: a file inside a package (folders with ``__init__.py`` above it) as
    ``package.module`` with the package root kept on ``sys.path``, so its absolute and relative imports (also
    those inside functions) work; a loose file as ``python path_text`` would, its folder first on ``sys.path``
    while it is imported.

    A loose file gets a private module name (one per resolved path), so two plug-in files with the same file
    name never replace each other; modules the file imports from its folder are imported normally.
    """
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise PluginLoadError(f"plug-in file {path_text!r} does not exist (resolved to {path.resolve()}); "
                              "check the path, which is relative to the current directory")
    resolved = path.resolve()
    package = package_of(resolved)
    if package is not None:
        module = _import_package_module(path_text, *package)
        IMPORTED[module.__name__] = how_imported(path_text)
        return module
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
        _run(path_text, lambda: spec.loader.exec_module(module))
    except PluginLoadError:
        del sys.modules[mod_name]
        raise
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above
    IMPORTED[mod_name] = how_imported(path_text)
    return module


def _import_package_module(path_text: str, root: Path, dotted: str) -> ModuleType:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # kept: code inside the package imports from it when it runs, not only now
    loaded = sys.modules.get(dotted)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != Path(path_text).resolve():
        raise PluginLoadError(f"{path_text!r} is module {dotted} of a package under {root}, but another {dotted} "
                              f"is already imported from {loaded.__file__}; check one of the two at a time")
    return _run(path_text, lambda: importlib.import_module(dotted))


def _run(path_text: str, load):
    """``load()``, its failures one :class:`PluginLoadError` line naming the cause (:func:`import_failure`)."""
    try:
        with plugin_exits(f"importing plug-in {path_text!r}"):
            return load()
    except PluginExit as exc:
        raise PluginLoadError(str(exc)) from None
    except Exception as exc:
        raise PluginLoadError(import_failure(f"importing plug-in {path_text!r}", exc)) from None


def import_failure(what: str, exc: BaseException) -> str:
    """``what`` failed, in one line naming the cause: a missing package by its name (and how to install it),
    anything else as its type and first line."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        return (f"{what} failed: it imports {exc.name!r}, which is not installed here (pip install {top}, or "
                f"install the project it comes from)")
    return f"{what} failed: {type(exc).__name__}: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``str(exc)`` (a multi-line message would break the one-line error)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
