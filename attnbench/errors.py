"""Exceptions a user can cause.

Every error a user can trigger (bad sizes, an unknown implementation name, a plug-in that does not
load, a device that is not here, a corrupt results file) is an :class:`AttnbenchError` subclass whose
message names the problem and what to do. The CLI prints these as one line without a traceback;
anything else is a programming error and is allowed to raise loudly.
"""

from __future__ import annotations


class AttnbenchError(Exception):
    """Base class of every error a user can cause."""


class InvalidSpecError(AttnbenchError, ValueError):
    """An :class:`~attnbench.spec.AttnSpec` (or a sweep axis) has impossible sizes."""


class InputShapeError(AttnbenchError, ValueError):
    """An input tensor does not fit the module's spec (rank, width, length)."""


class UnknownImplementationError(AttnbenchError, KeyError):
    """No implementation is registered under that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PluginLoadError(AttnbenchError, ImportError):
    """A plug-in (entry point, ``file.py:Class`` or ``module:Class``) does not load or build."""


class UnavailableError(AttnbenchError, RuntimeError):
    """An implementation, dtype or device cannot run on this machine."""


class SweepError(AttnbenchError, ValueError):
    """A sweep definition (flags, TOML file, preset) is malformed."""


class ResultsError(AttnbenchError, OSError):
    """A results folder is missing, corrupt, or belongs to another run."""


class RowError(ResultsError, ValueError):
    """A results row has a key that is not a column, or a value of the wrong type for its column."""


class OlderResultsWarning(UserWarning):
    """A run written by an older attnbench was read: the columns it lacked were filled in (the message names them)."""
