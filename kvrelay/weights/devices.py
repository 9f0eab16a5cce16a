"""Which devices a model may load on, checked before anything is read, converted or deleted.

Torch is imported by the functions, not here: the CLI lists ``DEVICE_TYPES`` in its flags' help, and a
``--help`` should not wait for torch to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.errors import DeviceError

if TYPE_CHECKING:
    import torch

DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_device(device: str | torch.device) -> torch.device:
    """The parsed device, or a ``DeviceError`` saying why it cannot be used on this machine."""
    import torch

    if isinstance(device, torch.device):
        parsed = device
    else:
        try:
            parsed = torch.device(str(device))
        except (RuntimeError, TypeError, ValueError):
            raise DeviceError(f"device {device!r}: unknown device; use one of {', '.join(DEVICE_TYPES)} "
                              "(cuda:N for a GPU index)") from None
    if parsed.type not in DEVICE_TYPES:
        raise DeviceError(f"device {device!r}: unsupported device type {parsed.type!r}; use one of "
                          f"{', '.join(DEVICE_TYPES)}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: CUDA is not available here (torch {torch.__version__} "
                              f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); "
                              "use --device cpu")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise DeviceError(f"device {device!r}: no such GPU (this machine has {count})")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {device!r}: MPS (Apple GPU) is not available here; use --device cpu")
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        raise DeviceError(f"device {device!r}: the CPU has no index {parsed.index}; use cpu")
    return parsed


def sync_device(device: torch.device | str) -> None:
    """Wait for the work queued on a GPU, so that a wall-clock time covers it (no-op on other devices)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
