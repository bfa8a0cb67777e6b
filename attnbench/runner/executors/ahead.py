"""The ``attnbench run`` command's first measuring worker, started before the command imports torch (issue 30).

A measuring worker takes seconds to be ready (torch, SciPy, the profiler's first use), and a default run waits for
it. :func:`start_for` is called by :mod:`attnbench.cli` before it imports anything heavy: when the command line is
``attnbench run`` without a setting that changes the worker's environment, it starts the worker for the default
settings at once, with only the light modules this one imports. :func:`take` hands it to the run
(:func:`attnbench.runner.executors.local.prestarted`) only when its environment variables are exactly those the run
would start its worker with; otherwise it is ended and the run starts its own, as it did before.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from attnbench.measure import cpu_env, machine_lock
from attnbench.runner import compile_cache
from attnbench.runner.executors import orphans

ENVIRONMENT_FLAGS = ("--cpu-allocator", "--threads", "--no-cpu-bind", "--isolate", "--executor", "--device", "--resume",
                     "--metric",  # issue 39: --metric instructions runs no measuring worker
                     "--preset", "--help", "-h")
"""Options of ``attnbench run`` after which the default worker would not be the run's (a sweep file, ``*.toml``,
too): nothing is started ahead."""
LABEL = "process0"


@dataclass
class Started:
    """A worker process started ahead: its process, stderr file, environment variables and label."""

    proc: subprocess.Popen
    stderr: object
    env: dict[str, str]
    label: str


_STARTED: Started | None = None


def spawn(env: dict[str, str], label: str) -> tuple[subprocess.Popen, object]:
    """Start ``python -m attnbench.runner.executors.worker`` with ``env``: its process and its stderr file.

    A session (and process group) of its own: Ctrl-C reaches only the runner, which then ends the group. It dies with
    this process (orphans.die_with_parent, given our pid) and inherits the machine lock's descriptors, so even a
    worker that outlived us would keep other measurements away."""
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen(orphans.worker_command(label, os.getpid()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, env=env, start_new_session=True, pass_fds=machine_lock.held_fds())
    return proc, stderr


def own_command(argv: Sequence[str]) -> bool:
    """Whether this process is the ``attnbench`` command (its script or ``python -m attnbench``), not a caller of the
    API or a test."""
    return bool(argv) and str(argv[0]).endswith(("attnbench", os.path.join("attnbench", "__main__.py")))


def default_worker_run(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is ``attnbench run ...`` whose first worker has the default environment (no option of
    :data:`ENVIRONMENT_FLAGS`, no sweep file)."""
    if not own_command(argv) or list(argv[1:2]) != ["run"]:
        return False
    for token in argv[2:]:
        if token.endswith(".toml") or any(token == f or token.startswith(f + "=") for f in ENVIRONMENT_FLAGS):
            return False
    return True


def default_env() -> dict[str, str]:
    """The environment variables of a default run's first worker, computed without importing torch."""
    env = cpu_env.CpuEnv("pinned", True, cpu_env.measuring_threads(None, True))
    return compile_cache.worker_env(cpu_env.process_env(env), importlib.metadata.version("torch"))


def start_for(argv: Sequence[str]) -> bool:
    """Start the default run's first worker now when ``argv`` is such a run (see the module); True when started."""
    global _STARTED
    if _STARTED is not None or not default_worker_run(argv):
        return False
    try:
        env = default_env()
        proc, stderr = spawn(env, LABEL)
    except Exception:  # noqa: BLE001  (an optimisation only: the run starts its worker itself and says what fails)
        return False
    _STARTED = Started(proc, stderr, env, LABEL)
    return True


def take(env: dict[str, str], label: str) -> tuple[subprocess.Popen, object] | None:
    """The worker started ahead when it was started with exactly ``env`` and ``label`` and is alive, else None (one
    that does not fit is ended)."""
    global _STARTED
    started, _STARTED = _STARTED, None
    if started is None:
        return None
    if started.env == env and started.label == label and started.proc.poll() is None:
        return started.proc, started.stderr
    _end(started)
    return None


def _end(started: Started) -> None:
    orphans.kill_group(started.proc.pid)  # not waited for yet: its pid is still its own
    with contextlib.suppress(OSError):
        started.proc.stdin.close()
    started.proc.wait()
    started.proc.stdout.close()
    started.stderr.close()


@atexit.register
def _end_unused() -> None:
    """A worker started ahead that no run took (a usage error, an early exit) ends with the command."""
    global _STARTED
    if _STARTED is not None:
        started, _STARTED = _STARTED, None
        _end(started)
