"""CUDA (TileLang) kernels of glm52::sparse_mla / sparse_mla_bwd vs the dense fp32 reference.

Tolerances: bf16 inputs, fp32 accumulation; the forward output is rounded to bf16 (rel. 2^-8) and the
kernel feeds bf16 probabilities to the P.V and gradient GEMMs, so we require relative L2 error <= 1e-2
(cosine >= 0.9999) on out/dq/dkv and abs error <= 1e-3 on lse.
"""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.sparse_mla import ref_sparse_mla
from helpers import assert_similar

pytest.importorskip("glm52_model.ops.cuda.sparse_mla_tl", reason="TileLang not installed")


def _inputs(S, Sk, H, topk, seed=0, masked_frac=0.25):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, H, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(Sk, 576, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(Sk, device="cuda", generator=g)[:topk] for _ in range(S)])
    drop = torch.rand(S, topk, device="cuda", generator=g) < masked_frac
    idx = torch.where(drop, -1, idx).to(torch.int32)
    idx[0] = -1  # one row with no valid slot: out 0, lse +inf, no gradient
    return q, kv, idx.contiguous()


@pytest.mark.parametrize("H", [16, 64, 128])
def test_sparse_mla_forward_backward_vs_reference(H):
    S, Sk, topk = 192, 640, 128
    q, kv, idx = _inputs(S, Sk, H, topk)
    scale = 576 ** -0.5
    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = torch.ops.glm52.sparse_mla(qa, kva, idx, scale, 512)
    assert out.dtype == torch.bfloat16 and out.shape == (S, H, 512) and lse.shape == (S, H)
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref_out, ref_lse = ref_sparse_mla(qr, kvr, idx, scale, 512)
    assert bool(torch.isinf(lse[0]).all()) and bool((out[0] == 0).all())
    assert_similar(out[1:].float(), ref_out[1:].float(), min_cos=0.9999, max_rel=1e-2, what="out")
    torch.testing.assert_close(lse[1:], ref_lse[1:].float(), atol=1e-3, rtol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out.float().backward(dout.float())
    assert bool((qa.grad[0] == 0).all())
    assert_similar(qa.grad.float(), qr.grad, min_cos=0.9999, max_rel=1e-2, what="dq")
    assert_similar(kva.grad.float(), kvr.grad, min_cos=0.9999, max_rel=1e-2, what="dkv")


def test_sparse_mla_cuda_matches_pytorch_kernel_small_topk_not_multiple_of_block():
    """topk = 100 (padded with -1 slots by the launcher) against the chunked PyTorch kernel."""
    from glm52_model.ops.sparse_mla import _sparse_mla_bwd_kernel, _sparse_mla_fwd_kernel
    S, Sk, H, topk = 96, 300, 32, 100
    q, kv, idx = _inputs(S, Sk, H, topk, seed=1)
    scale = 0.05
    out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, scale, 512)
    ro, rl = _sparse_mla_fwd_kernel(q, kv, idx, scale, 512)
    assert_similar(out[1:].float(), ro[1:].float(), min_cos=0.9999, max_rel=1e-2, what="out")
    torch.testing.assert_close(lse[1:], rl[1:], atol=1e-3, rtol=0)
    dout = torch.randn_like(out)
    dq, dkv = torch.ops.glm52.sparse_mla_bwd(q, kv, out, dout, idx, lse, scale, 512)
    rdq, rdkv = _sparse_mla_bwd_kernel(q, kv, ro, dout, idx, rl, scale, 512)
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype
    assert_similar(dq.float(), rdq.float(), min_cos=0.9999, max_rel=1e-2, what="dq")
    assert_similar(dkv.float(), rdkv.float(), min_cos=0.9999, max_rel=1e-2, what="dkv")
