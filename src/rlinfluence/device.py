"""Where a model runs and in what precision: ``resolve_device`` (``auto|cpu|cuda|cuda:N``) and
``resolve_dtype`` (``auto|float32|bfloat16``), each a one-line ``UserError`` for a name or a device
this machine does not have. Below the configs that validate a device and the models that use it."""

from __future__ import annotations

import torch

from rlinfluence.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> ``cuda`` if CUDA is available, else ``cpu``; ``"cpu"``; ``"cuda"`` /
    ``"cuda:N"``. ``UserError`` (one line) for CUDA on a machine without it, or another name."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r} requested, but CUDA is not available on this machine "
                            f"(torch {torch.__version__}); use --device cpu or auto")
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise UserError(f"unknown device {device!r} (choose auto, cpu, cuda or cuda:N)") from None
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return resolved
    raise UserError(f"unknown device {device!r} (choose auto, cpu, cuda or cuda:N)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> float32 (on CUDA too: LoRA training over a bfloat16 base went non-finite after
    its first update on an H200, and float32 did not); ``"float32"``; ``"bfloat16"``."""
    if dtype == "auto":
        return torch.float32
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r} (choose auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]
