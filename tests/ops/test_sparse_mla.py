"""glm52::sparse_mla (+ backward): opcheck, chunked kernel vs dense attention masked to the selected keys."""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops import sparse_mla as sparse_mla_mod
from glm52_model.ops.sparse_mla import ref_sparse_mla

OP = torch.ops.glm52.sparse_mla


def _inputs(S=24, H=4, D=48, d_v=32, T=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, D, generator=g).to(dtype)
    kv = torch.randn(S, D, generator=g).to(dtype)
    # causal random selection of distinct keys, -1 where fewer than T keys exist; row 0 has none
    idx = torch.full((S, T), -1, dtype=torch.int32)
    for i in range(1, S):
        perm = torch.randperm(i, generator=g)[:T]
        idx[i, :len(perm)] = perm.to(torch.int32)
    return q, kv, idx, D ** -0.5, d_v


def _fwd_bwd(fn, q, kv, idx, scale, d_v, dout):
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out, lse = fn(q, kv, idx, scale, d_v)
    out.backward(dout)
    return out, lse, q.grad, kv.grad


def test_matches_dense_masked_attention():
    q, kv, idx, scale, d_v = _inputs()
    dout = torch.randn(q.shape[0], q.shape[1], d_v)
    out, lse, dq, dkv = _fwd_bwd(OP, q, kv, idx, scale, d_v, dout)
    r_out, r_lse, r_dq, r_dkv = _fwd_bwd(ref_sparse_mla, q, kv, idx, scale, d_v, dout)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, r_out, **tol)
    torch.testing.assert_close(lse, r_lse, **tol)
    torch.testing.assert_close(dq, r_dq, **tol)
    torch.testing.assert_close(dkv, r_dkv, **tol)
    # row 0 selects nothing: zero output, lse = +inf, zero grads
    assert bool((out[0] == 0).all()) and bool(torch.isposinf(lse[0]).all()) and bool((dq[0] == 0).all())


def test_bf16_close_to_fp32():
    q, kv, idx, scale, d_v = _inputs(seed=1)
    out, lse = OP(q.bfloat16(), kv.bfloat16(), idx, scale, d_v)
    r_out, r_lse = ref_sparse_mla(q.bfloat16().float(), kv.bfloat16().float(), idx, scale, d_v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), r_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, r_lse, rtol=1e-4, atol=1e-4)


def test_chunking_is_invisible(monkeypatch):
    q, kv, idx, scale, d_v = _inputs(S=30)
    dout = torch.randn(30, q.shape[1], d_v)
    full = _fwd_bwd(OP, q, kv, idx, scale, d_v, dout)
    monkeypatch.setattr(sparse_mla_mod, "_CHUNK_ELEMENTS", 5 * 8 * (48 + 4))       # 5-row chunks
    for a, b in zip(_fwd_bwd(OP, q, kv, idx, scale, d_v, dout), full):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    q, kv, idx, scale, d_v = _inputs(S=12, dtype=dtype)
    q.requires_grad_(), kv.requires_grad_()
    torch.library.opcheck(OP, (q, kv, idx, scale, d_v))
    out, lse = OP(q, kv, idx, scale, d_v)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.glm52.sparse_mla_bwd,
                          (q.detach(), kv.detach(), out.detach(), dout, idx, lse, scale, d_v))


def test_cuda_backward_delta_by_chunks_equals_the_whole():
    """The CUDA backward's delta = sum(out * dout) in fp32 goes a few rows at a time (bounded temporaries):
    chunks that do not divide the rows, one row a chunk, and one chunk for all give the same [S, H]."""
    tl = pytest.importorskip("glm52_model.ops.cuda.sparse_mla_tl", reason="TileLang not installed")
    g = torch.Generator().manual_seed(3)
    out, dout = (torch.randn(37, 4, 64, generator=g).bfloat16() for _ in range(2))
    whole = (out.float() * dout.float()).sum(-1)
    for rows in (5, 1, 64):
        got = tl.row_dot(out, dout, rows * 4 * 4 * 64)
        assert got.dtype == torch.float32 and got.shape == (37, 4)
        assert torch.equal(got, whole), rows
    empty = tl.row_dot(out[:0], dout[:0], 1 << 20)  # no queries: an empty delta
    assert empty.shape == (0, 4) and empty.dtype == torch.float32


@pytest.mark.parametrize("heads,d_v,pipelined", [(64, 512, True), (48, 512, True), (16, 512, False),
                                                 (128, 512, False), (64, 448, False)])
def test_cuda_kernels_the_ops_run(heads, d_v, pipelined):
    """The ops' CUDA launchers run the warp-specialised kernels at 64 padded heads (d_v a multiple of 256), the
    serial ones elsewhere or when the config asks, each with its config's tunables and the indices padded to its
    slot blocks (two at a time for the pipelined kernels)."""
    tl = pytest.importorskip("glm52_model.ops.cuda.sparse_mla_tl", reason="TileLang not installed")
    ops, Hp = tl.SparseMlaConfig(), tl.padded_heads(heads)
    fwd, bwd = tl.fwd_kernel_choice(Hp, d_v, ops), tl.bwd_kernel_choice(Hp, d_v, ops)
    if pipelined:
        assert fwd == (tl.compile_sparse_mla_fwd_ws, ops.fwd_ws, 2 * ops.fwd_ws.block_I)
        assert bwd == (tl.compile_sparse_mla_bwd_ws, ops.bwd_ws, 2 * ops.bwd_ws.block_I)
    else:
        assert fwd[0] is tl.compile_sparse_mla_fwd and bwd[0] is tl.compile_sparse_mla_bwd
        assert bwd[1] == (ops.bwd_few_heads if Hp < 64 else ops.bwd) and bwd[2] == bwd[1].block_I
    serial = tl.SparseMlaConfig(pipelined_fwd=False, pipelined_bwd=False)
    assert tl.fwd_kernel_choice(Hp, d_v, serial)[0] is tl.compile_sparse_mla_fwd
    assert tl.bwd_kernel_choice(Hp, d_v, serial)[0] is tl.compile_sparse_mla_bwd


def test_deterministic_algorithms_run_the_pytorch_backward_instead_of_the_atomic_kernel(monkeypatch):
    """The TileLang backward adds dKV with fp32 atomics (an order that varies from run to run); under
    torch.use_deterministic_algorithms the CUDA kernel runs the PyTorch one (index_add_, deterministic there), with
    a warning that says why. Called here on CPU tensors, which the launcher otherwise hands to the TileLang kernel."""
    pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")
    from glm52_model.ops.cuda import sparse_mla_tl as tl

    q, kv, idx, scale, d_v = _inputs(S=16, H=4, D=128, d_v=64, T=8, dtype=torch.bfloat16)
    out, lse = sparse_mla_mod._sparse_mla_fwd_kernel(q, kv, idx, scale, d_v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)

    def picked(*args, **kwargs):
        raise LookupError("the TileLang kernel was picked")
    monkeypatch.setattr(tl, "bwd_kernel", picked)
    with pytest.raises(LookupError, match="TileLang kernel was picked"):
        tl.sparse_mla_bwd_tl(q, kv, out, dout, idx, lse, scale, d_v)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.warns(UserWarning, match="use_deterministic_algorithms is on.*fp32 atomics"):
            dq, dkv = tl.sparse_mla_bwd_tl(q, kv, out, dout, idx, lse, scale, d_v)
    finally:
        torch.use_deterministic_algorithms(was)
    r_dq, r_dkv = sparse_mla_mod._sparse_mla_bwd_kernel(q, kv, out, dout, idx, lse, scale, d_v)
    assert torch.equal(dq, r_dq) and torch.equal(dkv, r_dkv)
