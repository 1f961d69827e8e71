"""CUDA (TileLang) kernels of glm52::sparse_mla / sparse_mla_bwd vs the dense fp32 reference.

Tolerances: bf16 inputs, fp32 accumulation; the forward output is rounded to bf16 (rel. 2^-8) and the
kernel feeds bf16 probabilities to the P.V and gradient GEMMs, so we require relative L2 error <= 1e-2
(cosine >= 0.9999) on out/dq/dkv and abs error <= 1e-3 on lse.
"""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.sparse_mla import ref_sparse_mla
from tests.support.helpers import assert_similar

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


def _edge_inputs(S, Sk, H, topk, seed):
    """_inputs plus row 1 with only its last slot valid (the last latent row) and row 2 with only its first
    (latent row 0): the running max starts from the kernels' floor there."""
    q, kv, idx = _inputs(S, Sk, H, topk, seed=seed)
    idx[1, :-1] = -1
    idx[1, -1] = Sk - 1
    idx[2, 1:] = -1
    idx[2, 0] = 0
    return q, kv, idx


@pytest.mark.parametrize("S,Sk,topk,H", [(192, 640, 128, 64), (256, 4096, 2048, 64), (96, 300, 100, 48)])
def test_sparse_mla_pipelined_forward_vs_reference_and_serial(S, Sk, topk, H):
    """The warp-specialised forward (the op's at 64 padded heads) against the dense reference and the serial
    kernel (``SparseMlaConfig(pipelined_fwd=False)``): masked slots, a row with no valid slot, rows whose only
    valid slot is the last or the first (the running max starts from the -2^30 floor), topk a multiple of
    2 * block_I or padded up."""
    from unittest import mock
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    q, kv, idx = _edge_inputs(S, Sk, H, topk, seed=2)
    scale = 576 ** -0.5
    with mock.patch.object(tl, "compile_sparse_mla_fwd_ws", wraps=tl.compile_sparse_mla_fwd_ws) as ws:
        out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, scale, 512)
        assert ws.called, "the pipelined forward was not used"
    out_s, lse_s = tl.sparse_mla_tl(q, kv, idx, scale, 512, tl.SparseMlaConfig(pipelined_fwd=False))
    assert out.dtype == torch.bfloat16 and out.shape == (S, H, 512) and lse.shape == (S, H)
    ref_out, ref_lse = ref_sparse_mla(q.float(), kv.float(), idx, scale, 512)
    assert bool(torch.isinf(lse[0]).all()) and bool((out[0] == 0).all())
    assert bool(torch.isfinite(lse[1:]).all()) and bool(torch.isfinite(out.float()).all())
    assert_similar(out[1:].float(), ref_out[1:].float(), min_cos=0.9999, max_rel=1e-2, what="out")
    torch.testing.assert_close(lse[1:], ref_lse[1:].float(), atol=1e-3, rtol=0)
    for r in (1, 2):  # one valid slot: out is that latent row's values, lse its scaled score
        assert_similar(out[r].float(), ref_out[r].float(), min_cos=0.9999, max_rel=1e-2, what=f"out[{r}]")
    assert_similar(out[1:].float(), out_s[1:].float(), min_cos=0.9999, max_rel=1e-2, what="out vs serial")
    torch.testing.assert_close(lse[1:], lse_s[1:], atol=1e-3, rtol=0)


@pytest.mark.parametrize("S,Sk,topk,H,chunk", [
    (192, 640, 128, 64, 64), (256, 4096, 2048, 64, 64), (96, 300, 100, 48, 64), (192, 640, 128, 64, 128)])
def test_sparse_mla_pipelined_backward_vs_reference_and_serial(S, Sk, topk, H, chunk):
    """The warp-specialised backward (the op's at 64 padded heads; ``chunk``: its piece width, 64 the op's)
    against the dense reference's autograd and the serial kernel (``SparseMlaConfig(pipelined_bwd=False)``):
    masked slots, a row with no valid slot (dq = 0), rows whose only valid slot is the last or the first,
    duplicate-free indices, H = 64 and a padded head count (48), topk a multiple of 2 * block_I or padded up
    (100)."""
    from unittest import mock
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    q, kv, idx = _edge_inputs(S, Sk, H, topk, seed=3)
    scale = 576 ** -0.5
    out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, scale, 512)
    dout = torch.randn_like(out)
    config = tl.SparseMlaConfig(bwd_ws=tl.BwdWsConfig(chunk=chunk))
    with mock.patch.object(tl, "compile_sparse_mla_bwd_ws", wraps=tl.compile_sparse_mla_bwd_ws) as ws:
        dq, dkv = tl.sparse_mla_bwd_tl(q, kv, out, dout, idx, lse, scale, 512, config)
        assert ws.called and ws.call_args.args[-1].chunk == chunk, "the pipelined backward was not used"
    with mock.patch.object(tl, "compile_sparse_mla_bwd_ws", wraps=tl.compile_sparse_mla_bwd_ws) as ws:
        dq_s, dkv_s = tl.sparse_mla_bwd_tl(q, kv, out, dout, idx, lse, scale, 512,
                                           tl.SparseMlaConfig(pipelined_bwd=False))
        assert not ws.called
    assert dq.dtype == q.dtype and dq.shape == q.shape and dkv.dtype == kv.dtype and dkv.shape == kv.shape
    assert bool(torch.isfinite(dq.float()).all()) and bool(torch.isfinite(dkv.float()).all())
    assert bool((dq[0] == 0).all()), "a row with no valid slot must get dq = 0"
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref_out, _ = ref_sparse_mla(qr, kvr, idx, scale, 512)
    ref_out.float().backward(dout.float())
    assert_similar(dq.float(), qr.grad, min_cos=0.9999, max_rel=1e-2, what="dq")
    assert_similar(dkv.float(), kvr.grad, min_cos=0.9999, max_rel=1e-2, what="dkv")
    for r in (1, 2):  # one valid slot: P = 1 and dP = delta, so dS and that row's dq are 0 up to rounding
        assert float(dq[r].float().abs().max()) <= 1e-3 * float(dq.float().abs().max()), f"dq[{r}]"
    assert_similar(dq.float(), dq_s.float(), min_cos=0.9999, max_rel=1e-2, what="dq vs serial")
    assert_similar(dkv.float(), dkv_s.float(), min_cos=0.9999, max_rel=1e-2, what="dkv vs serial")
    untouched = torch.ones(Sk, dtype=torch.bool, device=idx.device)
    untouched[idx[idx >= 0].long()] = False           # latent rows no query selected: dkv exactly 0
    assert bool((dkv[untouched] == 0).all()) and bool((dkv_s[untouched] == 0).all())


@pytest.mark.parametrize("S,H,d_v", [(37, 4, 512), (5, 3, 448), (1, 64, 512), (0, 64, 512)])
def test_row_dot_vs_float64(S, H, d_v):
    """The backward's delta = sum(out * dout) in fp32, a chunk of rows at a time: rows not a multiple of a
    chunk, no rows; a non-contiguous dout."""
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    g = torch.Generator(device="cuda").manual_seed(S + H)
    out = torch.randn(S, H, d_v, device="cuda", generator=g).bfloat16()
    dout = torch.randn(S, d_v, H, device="cuda", generator=g).bfloat16().transpose(1, 2)
    got = tl.row_dot(out, dout, 7 * 4 * H * d_v)
    assert got.dtype == torch.float32 and got.shape == (S, H)
    torch.testing.assert_close(got.double(), (out.double() * dout.double()).sum(-1), rtol=1e-5, atol=1e-4)


def test_sparse_mla_bwd_memory_beyond_its_outputs_is_bounded():
    """The backward's delta = sum(out * dout) in fp32: at 8K queries x 64 heads, fp32 copies of out and dout and
    their product would be 3 GiB at once. It goes a chunk of rows at a time (at most 3 x delta_chunk_bytes of
    temporaries); beside them the backward holds only dq, dkv (and its fp32 accumulator), delta and the
    launcher's padded index copy; dq and dkv as with the whole tensors at once."""
    from glm52_model.ops.cuda import sparse_mla_tl as tl
    S, Sk, topk, H = 8192, 8192, 128, 64
    q, kv, idx = _inputs(S, Sk, H, topk, seed=5)
    scale = 576 ** -0.5
    out, lse = torch.ops.glm52.sparse_mla(q, kv, idx, scale, 512)
    dout = torch.randn_like(out)
    torch.ops.glm52.sparse_mla_bwd(q, kv, out, dout, idx, lse, scale, 512)  # kernels built, cache warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, dkv = torch.ops.glm52.sparse_mla_bwd(q, kv, out, dout, idx, lse, scale, 512)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = dq.numel() * dq.element_size() + kv.numel() * 4 + dkv.numel() * dkv.element_size()
    temporaries = 3 * tl.SparseMlaConfig().delta_chunk_bytes
    bound = outputs + S * H * 4 + temporaries + 2 * idx.numel() * 4 + (64 << 20)
    assert extra <= bound, f"backward took {extra / 2**20:.0f} MiB beyond its inputs, bound {bound / 2**20:.0f} MiB"
    one_chunk = tl.SparseMlaConfig(delta_chunk_bytes=1 << 40)                                # all rows at once
    dq1, dkv1 = tl.sparse_mla_bwd_tl(q, kv, out, dout, idx, lse, scale, 512, one_chunk)
    assert_similar(dq.float(), dq1.float(), min_cos=0.99999, max_rel=1e-3, what="dq vs unchunked")
    assert_similar(dkv.float(), dkv1.float(), min_cos=0.99999, max_rel=1e-3, what="dkv vs unchunked")
