"""Shared helpers for the TileLang kernels: target selection, padding, and the one-time warnings of the
launchers that hand an input to the PyTorch reference kernel. No TileLang import here: the fallbacks
registered without TileLang use this module too."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

TILELANG_PIN = "tilelang==0.1.15"
_warned: set[str] = set()


def cuda_target(device: torch.device | None = None) -> dict:
    """The TileLang target for `device` (the current CUDA device by default)."""
    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if major >= 9 else ""
    return {"kind": "cuda", "arch": f"sm_{major}{minor}{suffix}"}


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pad_dim(t: torch.Tensor, dim: int, size: int, value: float = 0) -> torch.Tensor:
    """`t` padded with `value` along `dim` up to `size` (returned as is when already that size)."""
    cur = t.shape[dim]
    if cur == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size - cur
    fill = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat([t, fill], dim=dim).contiguous()


def warn_once(key: str, message: str) -> None:
    """A UserWarning the first time `key` is seen in this process, nothing after."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def nondeterministic(op: str, why: str) -> tuple | None:
    """For a launcher's refusal: (warning key, message) where ``torch.use_deterministic_algorithms`` is on, since
    ``op``'s TileLang kernel varies from run to run (``why``), so its PyTorch kernel runs instead; None where it
    is off."""
    if not torch.are_deterministic_algorithms_enabled():
        return None
    return (f"{op}:deterministic", f"{op}: torch.use_deterministic_algorithms is on, so CUDA tensors run the PyTorch "
                                   f"reference kernel (slower; the TileLang kernel {why})")


def reference_fallback(op: str, reference: Callable) -> Callable:
    """The CUDA kernel of `op` when TileLang is missing: warns once, then runs `reference` (the op's
    PyTorch kernel, which checks its inputs as the op does)."""

    @functools.wraps(reference)
    def kernel(*args):
        warn_once(f"{op}:no-tilelang",
                  f"{op}: TileLang is not installed, so CUDA tensors run the PyTorch reference kernel (much "
                  f"slower). For the CUDA kernel: pip install {TILELANG_PIN}")
        return reference(*args)

    return kernel
