"""Shared helpers for the TileLang kernels: target selection and padding."""

from __future__ import annotations

import torch

# Hopper wgmma code needs the "a" arch variant; plain sm_90 fails in nvcc (FACTS.md).
SM90A_TARGET = {"kind": "cuda", "arch": "sm_90a"}


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
