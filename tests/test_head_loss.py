"""glm52_model.loss.head_loss: the output head and cross-entropy by row chunks, with their gradients computed in
the forward, against the unfused ``F.cross_entropy(linear(h, W).float(), t)``: the loss and both gradients, in
float64 (to rounding) and bf16 (to bf16's), with ignored targets, a parallel batch's count, several chunks, a
grad scale (the MTP weight), no-grad, and the saved bytes (nothing of the vocabulary's width)."""
import pytest
import torch
import torch.nn.functional as F

import glm52_model.loss as loss_mod
from glm52_model.loss import head_loss


def _inputs(dtype, tokens=37, hidden=24, vocab=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(vocab, hidden, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[::5] = -100
    return h, w, t


def _unfused(h, w, t, count=None, scale=1.0):
    logits = F.linear(h, w).float()
    loss = (F.cross_entropy(logits, t, ignore_index=-100) if count is None
            else F.cross_entropy(logits, t, ignore_index=-100, reduction="sum") / count)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("count", [None, 100])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.bfloat16, 2e-2)])
def test_the_chunked_loss_and_its_gradients_are_the_unfused_ones(monkeypatch, dtype, tol, count):
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 4 * 53 * 8)  # 8 rows a chunk: 5 chunks, the last short
    h, w, t = _inputs(dtype)
    ref_loss, ref_h, ref_w = _unfused(h, w, t, count, scale=0.3)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = head_loss(h2, w2, t, count)
    (loss * 0.3).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6 if dtype == torch.float64 else 1e-3, atol=0)
    assert h2.grad.dtype == dtype and w2.grad.dtype == dtype
    torch.testing.assert_close(h2.grad.double(), ref_h.double(), rtol=tol, atol=tol * ref_h.abs().max().item())
    torch.testing.assert_close(w2.grad.double(), ref_w.double(), rtol=tol, atol=tol * ref_w.abs().max().item())
    assert (h2.grad[::5] == 0).all()  # ignored targets: no gradient


def test_no_grad_gives_the_loss_alone_and_every_target_ignored_gives_nan():
    h, w, t = _inputs(torch.float64)
    with torch.no_grad():
        loss = head_loss(h, w, t)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100).detach())
    none = torch.full_like(t, -100)
    assert torch.isnan(head_loss(h, w, none)) and torch.isnan(F.cross_entropy(F.linear(h, w).float(), none))


def test_the_backward_keeps_nothing_of_the_vocabulary_s_width():
    """What the loss saves for the backward: the hidden states' gradient and the weight's (fp32), where the
    unfused loss keeps [tokens, vocab] fp32 log-probabilities (and autograd the logits' cast)."""
    tokens, hidden, vocab = 256, 16, 4096
    h, w, t = _inputs(torch.bfloat16, tokens, hidden, vocab)
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        head_loss(h, w, t)
    assert sum(saved) == tokens * hidden * 2 + vocab * hidden * 4, saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)
    assert sum(saved) >= tokens * vocab * 4


def test_shapes_that_do_not_fit_are_refused():
    h, w, t = _inputs(torch.float64)
    with pytest.raises(ValueError, match=r"head_loss: hidden \[tokens, hidden\] \(37, 24\).*do not fit"):
        head_loss(h, w[:, :5], t)
    with pytest.raises(ValueError, match="do not fit"):
        head_loss(h, w, t[:3])
