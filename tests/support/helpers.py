"""Shared test helpers: ONE similarity measure for FP8 (and other lossy) comparisons."""
from __future__ import annotations

import contextlib

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


def eager_step(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of a causal LM (``model(ids, labels=ids)``): its loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_steps_match(model, ids, reference: tuple[torch.Tensor, dict[str, torch.Tensor]], steps: int = 3,
                       before_step=lambda: None) -> None:
    """``steps`` training steps of ``model``, each with ``reference``'s loss and gradients (an eager step's,
    :func:`eager_step`), to fp32 reordering; ``before_step`` runs before each."""
    loss_e, grads_e = reference
    for _ in range(steps):
        before_step()
        loss, grads = eager_step(model, ids)
        torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-5)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@contextlib.contextmanager
def stashed_values_checked(monkeypatch):
    """Within it, every value a model plan stashes is copied as the forward stashes it and compared, bit for bit,
    with what its backward unstashes (kept on the device or reloaded from the host). Yields the list of results,
    one bool per unstashed value; a value stashed and never unstashed fails on exit."""
    from sacpass.offload.runtime import Runtime

    stash, unstash = Runtime.stash, Runtime.unstash
    stashed, checked = {}, []

    def checked_stash(self, x, *args, **kwargs):
        handle = stash(self, x, *args, **kwargs)
        stashed[int(handle[0])] = x.detach().clone()
        return handle

    def checked_unstash(self, handle, *args, **kwargs):
        out = unstash(self, handle, *args, **kwargs)
        expected = stashed.pop(int(handle[0]))
        checked.append(out.dtype == expected.dtype and out.shape == expected.shape and out.stride() == expected.stride()
                       and torch.equal(out.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)))
        return out

    monkeypatch.setattr(Runtime, "stash", checked_stash)
    monkeypatch.setattr(Runtime, "unstash", checked_unstash)
    yield checked
    assert not stashed, f"{len(stashed)} stashed values never unstashed"
