"""Torch's global switches a user's module turns as it is imported, put back and said.

Importing a file must not change what every case runs under. min-dalle's ``min_dalle.py`` calls
``torch.set_grad_enabled(False)`` at import (an inference package, imported by its model modules through the
package's ``__init__``): every backward case then raised "element 0 of tensors does not require grad", and the forward
cases too (the check takes gradients). :func:`kept` restores each switch of :data:`SWITCHES` that an import turned;
:func:`lines` says which, for ``attnbench check -v``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def _set_device(device: torch.device) -> None:
    """Put the default device back; the CPU as no default at all (``set_default_device("cpu")`` would push a
    ``TorchFunctionMode`` of its own, one more mode under every call and under the localiser's recorder)."""
    torch.set_default_device(None if device.type == "cpu" else device)


SWITCHES = {
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (torch.get_default_device, _set_device),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "anomaly detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
}
"""Global switches of torch that change what a case computes or whether it can take gradients: name -> (get, set)."""

TURNED: dict[str, list[str]] = {}
"""Module name -> the switches its import turned (and attnbench put back), as words."""


@contextmanager
def kept(turned: list[str]):
    """Run an import; afterwards (whatever happened) put back each switch it turned, appending what it was to
    ``turned`` (``"grad mode: True -> False"``)."""
    before = {name: get() for name, (get, _) in SWITCHES.items()}
    try:
        yield
    finally:
        for name, (get, put) in SWITCHES.items():
            now = get()
            if now != before[name]:
                put(before[name])
                turned.append(f"{name}: {before[name]} -> {now}")


def note(module, turned: list[str]) -> None:
    """Keep what importing ``module`` turned, for :func:`lines`."""
    if turned and module is not None:
        TURNED.setdefault(module.__name__, []).extend(turned)


def lines(target) -> list[str]:
    """The ``-v`` line for a class whose module's import turned a switch, or none."""
    turned = TURNED.get(getattr(target, "__module__", ""), [])
    if not turned:
        return []
    return [f"import side effect: importing its module turned torch's {'; '.join(dict.fromkeys(turned))}; attnbench put "
            "it back, so every case runs as it runs in a fresh process"]
