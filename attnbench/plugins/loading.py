"""Importing plug-in files, and the ``NAME=target`` form that gives an implementation a short display name."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import linecache
import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path
from types import ModuleType

from attnbench.errors import PluginLoadError
from attnbench.plugins import import_state
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
    parts, folder, top = [path.stem], path.parent, None
    while folder.name.isidentifier() and ((folder / "__init__.py").is_file() or (folder.parent / "__init__.py").is_file()):
        parts.insert(0, folder.name)  # a folder without __init__.py right under a package: a namespace subpackage
        if (folder / "__init__.py").is_file():  # (nano-vllm's nanovllm/layers/), imported by its full name as Python
            top = len(parts)                    # run from the root would, its package's __init__ first
        folder = folder.parent
    if top is None:
        return None
    return path.parents[top - 1], ".".join(parts[-top:])


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
        try:
            module = _import_package_module(path_text, *package)
        except PluginLoadError as exc:  # a package inside a folder without __init__.py, imported by its full name
            rooted = _namespace_root(resolved, exc.__context__)
            if rooted is None or rooted == package:
                alone = _standalone(path_text, resolved, exc.__context__)
                if alone is None:
                    raise
                return alone
            sys.modules.pop(package[1], None)
            module = _import_package_module(path_text, *rooted)
            IMPORTED[module.__name__] = (f"imported {resolved.name} as {rooted[1]}: its package imports "
                                         f"{rooted[1].split('.')[0]!r}, a folder without __init__.py, so {rooted[0]} "
                                         "is on sys.path")
            return module
        IMPORTED[module.__name__] = how_imported(path_text)
        return module
    mod_name = _script_name(resolved)
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    try:
        return _import_script(path_text, resolved, mod_name)
    except PluginLoadError as exc:
        rooted = _namespace_root(resolved, exc.__context__)  # what the import raised
        if rooted is None:
            raise
        module = _import_package_module(path_text, *rooted)
        IMPORTED[module.__name__] = (f"imported {resolved.name} as {rooted[1]}: it imports {rooted[1].split('.')[0]!r}, "
                                     f"a folder of its repository without __init__.py, so {rooted[0]} is on sys.path")
        return module


def _script_name(resolved: Path) -> str:
    """The private module name of a file imported as a script: one per resolved path."""
    return f"attnbench_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"


def _standalone(path_text: str, resolved: Path, exc: BaseException | None) -> ModuleType | None:
    """The file imported by its path when its package's ``__init__`` needs a module that is not installed and that the
    file itself does not import, with no relative import of its own (Stability AI's ``sgm/modules/attention.py``: the
    package imports kornia, the file only torch and einops); ``None`` otherwise (the package's refusal stands)."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing:
        return None
    tree = ast.parse(resolved.read_text(encoding="utf-8", errors="replace"))
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    own = {a.name.split(".")[0] for n in imports if isinstance(n, ast.Import) for a in n.names}
    own |= {n.module.split(".")[0] for n in imports if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
    if missing.split(".")[0] in own or any(isinstance(n, ast.ImportFrom) and n.level > 0 for n in imports):
        return None
    mod_name = _script_name(resolved)
    try:
        module = sys.modules.get(mod_name) or _import_script(path_text, resolved, mod_name)
    except PluginLoadError:
        return None
    IMPORTED[mod_name] = (f"imported {resolved.name} by its path, as a script: its package's __init__ imports "
                          f"{missing!r}, which is not installed here, and the file itself does not")
    return module


def _namespace_root(resolved: Path, exc: BaseException | None) -> tuple[Path, str] | None:
    """``(root, "top.sub.module")`` when a loose file failed to import ``top...`` and ``top`` is a folder (or
    ``top.py``) of an ancestor ``root`` of the file which holds the file too: the repository's own code, imported by
    its absolute name from the root Python is run at (stable-diffusion's ``ldm``, flux's ``flux``: folders without
    ``__init__.py``, namespace packages). ``None`` otherwise: then a missing name is a missing package. A file whose
    relative import (``from .rope import ...``) failed for want of a package is imported as ``folder.module``, its
    folder a namespace package."""
    if isinstance(exc, ImportError) and "no known parent package" in str(exc):
        parts = [resolved.parent.name, resolved.stem]
        return (resolved.parent.parent, ".".join(parts)) if all(p.isidentifier() for p in parts) else None
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    for root in resolved.parents:
        if (root / top).is_dir() or (root / f"{top}.py").is_file():
            parts = [*resolved.relative_to(root).parent.parts, resolved.stem]
            return (root, ".".join(parts)) if all(p.isidentifier() for p in parts) else None
        if (root / ".git").exists():
            return None  # not above the repository
    return None


def _import_script(path_text: str, resolved: Path, mod_name: str) -> ModuleType:
    """A loose file imported as ``python path_text`` would (its folder first on ``sys.path``), as ``mod_name``."""
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise PluginLoadError(f"cannot import {path_text!r} as Python; it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    folder, argv = str(resolved.parent), list(sys.argv)
    sys.path.insert(0, folder)
    # as `python file.py` with no arguments: a script that reads the files beside sys.argv[0] (modded-nanogpt) finds
    # them, and one that parses its arguments at import (argparse) does not read attnbench's own
    sys.argv[:] = [str(resolved)]
    try:
        _run(f"importing plug-in {path_text!r}", lambda: spec.loader.exec_module(module) or module)
    except PluginLoadError:
        del sys.modules[mod_name]
        raise
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above
        sys.argv[:] = argv
    IMPORTED[mod_name] = how_imported(path_text)
    return module


def _import_package_module(path_text: str, root: Path, dotted: str) -> ModuleType:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # kept: code inside the package imports from it when it runs, not only now
    loaded = sys.modules.get(dotted)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != Path(path_text).resolve():
        raise PluginLoadError(f"{path_text!r} is module {dotted} of a package under {root}, but another {dotted} "
                              f"is already imported from {loaded.__file__}; check one of the two at a time")
    return _run(f"importing plug-in {path_text!r}", lambda: importlib.import_module(dotted))


def _run(what: str, load, module: str = ""):
    """``load()`` (``what``: importing a file, or the ``module``), its failures a :class:`PluginLoadError` naming the
    first cause (:func:`import_error`); a ``module`` that is itself missing (or its package) is "not found"."""
    turned: list[str] = []
    try:
        with plugin_exits(what), import_state.kept(turned):  # min-dalle's set_grad_enabled(False): put back
            module = load()
        import_state.note(module, turned)
        return module
    except PluginExit as exc:
        raise PluginLoadError(str(exc)) from None
    except Exception as exc:
        if module and isinstance(exc, ModuleNotFoundError) and exc.name and _is_prefix(exc.name, module):
            raise PluginLoadError(f"module {module!r} not found ({exc}); install it or add its folder to "
                                  "PYTHONPATH") from None
        raise import_error(what, exc) from None


def import_module_path(mod_path: str) -> ModuleType:
    """Import ``package.module`` (the ``module:Class`` form). A module that is not there is "not found"; a module
    that is there but fails while it is imported (a dependency missing, an assert) is named like a plug-in file's
    (:func:`import_error`). A package that is not installed but sits in the ``src/`` folder of the current directory
    (the src layout, run from the repository's root before ``pip install -e .``) is imported from there, and
    ``check -v`` says so."""
    top = mod_path.split(".")[0]
    src = Path.cwd() / "src"
    if importlib.util.find_spec(top) is None and top.isidentifier() and (src / top).is_dir():
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))  # kept: the package imports from itself when its code runs
        module = _run(f"importing {mod_path!r}", lambda: importlib.import_module(mod_path), module=mod_path)
        IMPORTED[module.__name__] = (f"imported {mod_path} from {src} (its package {top!r} is not installed; it is "
                                     "in the src/ folder here, so that folder is on sys.path)")
        return module
    return _run(f"importing {mod_path!r}", lambda: importlib.import_module(mod_path), module=mod_path)


def _is_prefix(name: str, dotted: str) -> bool:
    """``name`` is ``dotted`` or one of the packages it sits in (``pkg`` of ``pkg.mod``)."""
    return dotted == name or dotted.startswith(name + ".")


def import_failure(what: str, exc: BaseException) -> str:
    """``what`` failed, in one line naming the cause (:func:`import_error`'s message)."""
    return str(import_error(what, exc))


def import_error(what: str, exc: BaseException) -> PluginLoadError:
    """``what`` (importing a file or a module) failed with ``exc``: a :class:`PluginLoadError` whose headline is the
    first true cause: a missing package by its name (and how to install it), CUDA when the failing line or the
    message asks for it on a machine without, else the exception's type and first line, or for one without a
    message (a bare ``assert``) the failing line itself. Its details name the innermost frame in the user's files
    (``file:line: source``)."""
    frame = user_frame(exc)
    where = [f"at {frame[0]}:{frame[1]}: {frame[2]}"] if frame else []
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        own = own_module(Path(frame[0]), top) if frame else None
        if own is not None:  # transformer-xl's sys.path.append('utils'): a path relative to where it is run from
            return PluginLoadError(f"{what} failed: it imports {exc.name!r}, which is not installed here: its repository has "
                                   f"it at {own}, a folder that is not on sys.path from here", details=where,
                                   fix=f"PYTHONPATH={own.parent} attnbench ..., or run attnbench from the folder the "
                                       "file expects to be run from (a sys.path it extends relative to it)")
        return PluginLoadError(f"{what} failed: it imports {exc.name!r}, which is not installed here",
                               details=where, fix=f"pip install {top}, or install the project it comes from")
    message = first_line(exc)
    if isinstance(exc, SyntaxError):
        return PluginLoadError(f"{what} failed: {type(exc).__name__}: {exc.msg}", details=where)
    if not message and frame:  # a bare assert or raise: the failing line says what it wanted
        cause, where = f"{type(exc).__name__} at {Path(frame[0]).name}:{frame[1]}: {frame[2]}", []
    else:
        cause = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if _needs_cuda(message, frame):
        return PluginLoadError(f"{what} failed: it needs CUDA, which this machine does not have ({cause})",
                               details=where, fix="run it on a machine with CUDA, or point --impl at a file that "
                                               "imports without it")
    return PluginLoadError(f"{what} failed: {cause}", details=where)


OWN_MODULE_FILES = 20000
"""At most this many files of a repository are looked through for a module it imports but cannot find."""
REPOSITORY_ROOT = (".git", "pyproject.toml", "setup.py", "README*", "LICENSE*")


def own_module(file: Path, top: str) -> Path | None:
    """``top.py`` (or ``top/__init__.py``) inside the repository ``file`` belongs to (from the nearest folder above it
    that looks like a repository's root: ``.git``, ``pyproject.toml``, ``setup.py``, a README or a LICENSE; at most 3
    above the file, else its own folder), when a module of that name is there; else None."""
    root = next((f for f in [file.parent, *file.parents][:4] if any(any(f.glob(m)) for m in REPOSITORY_ROOT)),
                file.parent)
    seen = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("node_modules", "__pycache__"))
        seen += len(files)
        if f"{top}.py" in files:
            return Path(folder) / f"{top}.py"
        if top in dirs and (Path(folder) / top / "__init__.py").is_file():
            return Path(folder) / top / "__init__.py"
        if seen > OWN_MODULE_FILES:
            return None
    return None


def _needs_cuda(message: str, frame: tuple[str, int, str] | None) -> bool:
    """The failure asks for CUDA (its message or the failing line says so) and this machine has none."""
    import torch

    said = f"{message} {frame[2] if frame else ''}".lower()
    return ("cuda" in said or "nvidia" in said) and not torch.cuda.is_available()


_LIBRARY = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                                                      "platlib")})
_OURS = str(Path(__file__).resolve().parents[1])


def user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """``(file, line, source)`` of the innermost frame of ``exc`` in the user's files: not attnbench's, not
    Python's import machinery, not the standard library's or an installed package's (an installed package's
    when every frame is one: the module checked is installed); the file as given when it is under the current
    folder, its source the failing statement on one line. A ``SyntaxError`` names the line it points at."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        text = (exc.text or "").strip()
        return _shown(exc.filename), exc.lineno, text if len(text) <= 100 else text[:98].rstrip() + " …"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and not str(Path(f.filename).resolve()).startswith(_OURS)]
    own = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_LIBRARY)]
    frame = (own or frames or [None])[-1]
    if frame is None or not frame.lineno:
        return None
    first, last = _statement(frame.filename, frame.lineno)
    return _shown(frame.filename), first, _source(frame.filename, first, last)


def _shown(filename: str) -> str:
    """``filename`` relative to the current folder when it is under it, else as it is."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def _source(filename: str, first: int, last: int, limit: int = 100) -> str:
    """Lines ``first``..``last`` of ``filename`` (a statement: an ``assert`` over two lines, both; at most four) on
    one line of at most ``limit`` characters, without comments."""
    text = " ".join(_code(linecache.getline(filename, n)) for n in range(first, min(last, first + 3) + 1)).strip()
    return text if len(text) <= limit else text[:limit - 2].rstrip() + " …"


def _code(line: str) -> str:
    """``line`` without its comment and a continuation backslash, stripped."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote and line[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            line = line[:i]
            break
    return line.strip().removesuffix("\\").strip()


def _statement(filename: str, line: int) -> tuple[int, int]:
    """The first and last line of the innermost statement of ``filename`` that holds line ``line``."""
    try:
        tree = ast.parse(Path(filename).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return line, line
    spans = [(node.lineno, node.end_lineno or node.lineno) for node in ast.walk(tree)
             if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno)]
    return min(spans, key=lambda span: span[1] - span[0], default=(line, line))


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``str(exc)`` (a multi-line message would break the one-line error)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
