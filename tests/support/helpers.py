"""Shared test helpers: ONE similarity measure for FP8 (and other lossy) comparisons."""
from __future__ import annotations

import torch


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Global cosine similarity of two tensors viewed as flat fp64 vectors (1.0 = identical direction)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    denom = (a.norm() * b.norm()).clamp_min(1e-30)
    return float((a @ b) / denom)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (b is the reference)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_similar(actual: torch.Tensor, expected: torch.Tensor, *, min_cos: float, max_rel: float,
                   what: str = "tensor") -> None:
    """Fail unless cosine similarity >= min_cos and relative L2 error <= max_rel."""
    cos, rel = cosine_similarity(actual, expected), relative_error(actual, expected)
    assert cos >= min_cos and rel <= max_rel, (
        f"{what}: cosine {cos:.6f} (need >= {min_cos}), relative error {rel:.3e} (need <= {max_rel})")
