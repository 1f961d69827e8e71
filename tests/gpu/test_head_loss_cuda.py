"""glm52_model.loss.head_loss on a GPU at the bench preset's widths (hidden 6144, vocabulary 32768), bf16: the
loss and both gradients against the unfused ``F.cross_entropy(linear(h, W).float(), t)``, eager and inside a
compiled function, and the memory it takes beyond its inputs and gradients: a few chunks of fp32 logits, where
the unfused loss holds the whole [tokens, vocab] at once."""
import torch
import torch.nn.functional as F

from glm52_model import GLM52Config
from glm52_model.loss import CHUNK_BYTES, head_loss

TOKENS = 16384


def _inputs(tokens=TOKENS):
    cfg = GLM52Config.preset("bench")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.02 * torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    t = torch.randint(0, cfg.vocab_size, (tokens,), device="cuda", generator=g)
    t[::7] = -100
    return h, w, t


def _grads(fn, h, w, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _unfused(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def test_the_chunked_loss_matches_the_unfused_one_eager_and_compiled():
    h, w, t = _inputs()
    ref = _grads(_unfused, h, w, t)
    for fn in (head_loss, torch.compile(head_loss)):
        loss, gh, gw = _grads(fn, h, w, t)
        torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=0)
        for got, want in ((gh, ref[1]), (gw, ref[2])):
            assert got.dtype == torch.bfloat16
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < 1e-2, err
        assert (gh[::7] == 0).all()


def test_the_chunked_loss_holds_a_few_chunks_beyond_its_inputs_and_gradients():
    """At 64K tokens (the bench's): what the loss takes beyond its inputs is the gradients it keeps (hidden's
    bf16, the weight's fp32), a chunk's product for the weight's gradient (bf16 and its fp32 cast, the weight's
    size) and a few chunks of fp32 logits; the unfused loss holds the whole [tokens, vocab] fp32 logits."""
    tokens = 65536
    h, w, t = _inputs(tokens)
    h.requires_grad_()
    w.requires_grad_()
    vocab = w.shape[0]
    kept = h.numel() * 2 + w.numel() * 4
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = head_loss(h, w, t)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    bound = kept + w.numel() * (2 + 4) + 4 * CHUNK_BYTES
    assert extra <= bound, (extra / 2**30, bound / 2**30)
    del loss
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    unfused = _unfused(h, w, t)
    unfused_extra = torch.cuda.max_memory_allocated() - base
    assert unfused_extra >= tokens * vocab * 4 > bound, (unfused_extra / 2**30, bound / 2**30)
    print(f"head_loss at {tokens} tokens: {extra / 2**30:.2f} GiB beyond its inputs, the unfused loss "
          f"{unfused_extra / 2**30:.2f} GiB")
    del unfused
