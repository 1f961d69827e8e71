"""glm52::fp8_grouped_mm on CUDA: the cuBLASLt blockwise GEMMs per expert match the CPU fake-quant kernel
(only bf16 output rounding and accumulation order differ), and FP8 vs bf16 stays within the dense FP8
linears' error, forward and both gradients, with uneven and empty groups; the forward's in-place per-expert
GEMMs and their tails element by element against the fake-quant reference."""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.grouped_mm import ref_grouped_mm
from tests.support.helpers import assert_similar

OP, BWD = torch.ops.glm52.fp8_grouped_mm, torch.ops.glm52.fp8_grouped_mm_bwd


@pytest.mark.parametrize("R,K,N,offs", [(1000, 512, 384, (100, 100, 700, 990)), (4096, 1024, 2048, (1024, 2048, 3072, 4096))])
def test_cuda_matches_cpu_kernel(R, K, N, offs):
    torch.manual_seed(0)
    x = torch.randn(R, K)
    w = torch.randn(len(offs), K, N) * K ** -0.5
    dy = torch.randn(R, N)
    o = torch.tensor(offs, dtype=torch.int32)
    y_ref = OP(x, w, o)                                                          # CPU: fp32 fake quant
    dx_ref, dw_ref = BWD(dy, x, w, o)
    oc = o.cuda()
    y = OP(x.cuda().bfloat16(), w.cuda().bfloat16(), oc)
    dx, dw = BWD(dy.cuda().bfloat16(), x.cuda().bfloat16(), w.cuda().bfloat16(), oc)
    assert y.dtype == torch.bfloat16 and dw.shape == w.shape
    # bf16 inputs round before quantisation: compare at bf16 level, not bit level
    for got, ref, what in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dw")):
        assert_similar(got.float().cpu(), ref, min_cos=0.9995, max_rel=0.03, what=what)
    assert bool((y[offs[-1]:] == 0).all()) and bool((dx[offs[-1]:] == 0).all())
    if offs[0] == offs[1]:
        assert bool((dw[1] == 0).all())


def test_cuda_fp8_vs_bf16_grads():
    torch.manual_seed(1)
    R, K, N = 2048, 1024, 768
    offs = torch.tensor([300, 300, 1500, 2048], dtype=torch.int32, device="cuda")
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, K, N, device="cuda") * K ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    OP(x, w, offs).backward(dy)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y32 = ref_grouped_mm(x32, w32, offs)
    y32.backward(dy.float())
    assert_similar(OP(x, w, offs).float(), y32.detach(), min_cos=0.998, max_rel=0.06, what="y")
    assert_similar(x.grad.float(), x32.grad, min_cos=0.998, max_rel=0.06, what="dx")
    assert_similar(w.grad.float(), w32.grad, min_cos=0.998, max_rel=0.06, what="dw")


@pytest.mark.parametrize("gemm_rows", [128, 16])
@pytest.mark.parametrize("K,N", [(512, 384), (1024, 200), (640, 256)])
def test_cuda_forward_rows_in_place_uneven_groups(gemm_rows, K, N):
    """The forward's GEMMs on each expert's rows, written into y in place (torch._scaled_mm with out=; K=640
    takes blockwise_scaled_mm's K/128 % 4 padding first), with a padded tail GEMM per expert of ``gemm_rows``
    rows, 128 and the op's 16 (cuBLASLt refused arbitrary row counts, gemm_rows 1, on the H200), with the
    quantisers the op's CUDA kernel uses: uneven groups, an empty expert, 1-row experts, rows of no expert,
    N % 128 != 0.
    Against the fake-quant reference on the same bf16 inputs, element by element (bf16 output rounding and
    accumulation order only: a misplaced row or a wrong tail row is off by O(1))."""
    from glm52_model.ops import fp8_grouped_mm as fgm
    from glm52_model.ops.cuda import TILELANG_AVAILABLE

    if TILELANG_AVAILABLE:
        from glm52_model.ops.cuda.fp8_quant_tl import tilelang_quantisers
    quant = tilelang_quantisers() if TILELANG_AVAILABLE else fgm.TORCH_QUANTISERS
    torch.manual_seed(4)
    R = 1200
    offs = torch.tensor([0, 1, 131, 131, 260, 261, 1000, 1100], dtype=torch.int32, device="cuda")
    x = torch.randn(R, K, device="cuda").bfloat16()
    w = (torch.randn(len(offs), K, N, device="cuda") * K ** -0.5).bfloat16()
    y = fgm.fp8_grouped_mm_kernel(x, w, offs, quant, gemm_rows=gemm_rows)
    if gemm_rows == fgm.GEMM_ROWS:
        assert torch.equal(y, OP(x, w, offs)), "the op's CUDA kernel is this kernel with these quantisers"
    ref = fgm.ref_fp8_grouped_mm(x.float(), w.float(), offs)
    assert y.shape == (R, N) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -6, atol=1e-3 * ref.abs().max().item())
    assert bool((y[1100:] == 0).all())


@pytest.mark.parametrize("cols", [6144, 200])
def test_tilelang_quantisers_equal_the_torch_quantisers(cols):
    """The single-pass kernels compute what glm52_model.ops.fp8 computes: same scales, same fp8 bytes, with
    the experts' slot layout (row map with -1 rows) filled in the same pass."""
    from glm52_model.ops.cuda import fp8_quant_tl as tl
    from glm52_model.ops.fp8 import quantize_1x128, quantize_1x128_t, quantize_128x128
    from glm52_model.ops.fp8_grouped_mm import TORCH_QUANTISERS, expert_cols
    from glm52_model.ops.grouped_mm import group_slots, slot_rows

    torch.manual_seed(2)
    R = 1000
    x = (torch.randn(R, cols, device="cuda") * torch.logspace(-2, 2, cols, device="cuda")).bfloat16()
    offs = torch.tensor([100, 100, 700, 990], dtype=torch.int32, device="cuda")
    src, dest, poffs = group_slots(offs, R, 128)
    total = int(poffs[-1])
    got, want = tl._rows(x, src, dest, total), TORCH_QUANTISERS.rows(x, src, dest, total)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    pad = torch.ones(total, dtype=torch.bool, device="cuda")
    pad[dest] = False                                                           # slot padding: data 0
    assert torch.equal(got[1][~pad], want[1][~pad])
    assert bool((got[0].view(torch.uint8)[pad] == 0).all())
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    slot_ends = poffs.tolist()
    got, want = tl._cols(x, src, dest, poffs, slot_ends), TORCH_QUANTISERS.cols(x, src, dest, poffs, slot_ends)
    assert got[0].shape == want[0].shape and torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert poffs.tolist() == [128, 128, 768, 1152]
    for p0, p1 in ((0, 128), (128, 768), (768, 1152)):                          # each expert's operand in place
        q, s = expert_cols(*got, cols, p0, p1)
        assert q.is_contiguous() and s.is_contiguous()
        q2, s2 = quantize_1x128_t(slot_rows(x, src, dest, total)[p0:p1])
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    q, s = tl.quant_rows(x, tl.row_map(torch.arange(R, device="cuda"), torch.arange(R, device="cuda"), R, 32), R)
    q2, s2 = quantize_1x128(x)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    w = torch.randn(3, 300, cols, device="cuda").bfloat16()
    qb, sb = tl.quant_blocks(w)
    qb2, sb2 = quantize_128x128(w)
    assert torch.equal(sb, sb2) and torch.equal(qb.view(torch.uint8), qb2.view(torch.uint8))
    qb, sb = tl.quant_blocks(w, transpose=True)                                 # the blocks of each w[b].T
    qb2, sb2 = quantize_128x128(w.transpose(1, 2))
    assert torch.equal(sb, sb2) and torch.equal(qb.view(torch.uint8), qb2.view(torch.uint8))


@pytest.mark.parametrize("tiles", ["1x128", "1x128_t", "128x128"])
def test_fp8_quantize_op_on_the_tilelang_kernels_is_bit_exact(tiles):
    """glm52::fp8_quantize on CUDA (what the dense FP8 linears run: the TileLang kernels) gives the PyTorch
    quantisers' bytes and scales, including dims that are not multiples of 128."""
    pytest.importorskip("glm52_model.ops.cuda.fp8_quant_tl", reason="TileLang not installed")
    from glm52_model.ops.fp8 import _fp8_quantize_kernel

    x = (torch.randn(333, 200, device="cuda") * 10).bfloat16()
    q, s = torch.ops.glm52.fp8_quantize(x, tiles)
    q2, s2 = _fp8_quantize_kernel(x, tiles)
    assert q.shape == q2.shape and s.shape == s2.shape
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def test_cuda_gathered_rows_are_the_gathered_copy():
    """``rows`` on CUDA (the TileLang quantisers read x's rows in place): y and dw equal the op over the gathered
    copy x[rows] bit for bit, dx is that op's dx summed per token in fp32 in expert order (the CPU's
    sequential index_add in row order: the same adds), and two backwards give the same bits."""
    from tests.ops.test_grouped_mm import _routed
    x, w, offs, rows = _routed(T=2048, K=1024, N=768, k=4, E=9, seed=3)
    x, w = x.detach().cuda().bfloat16(), (w.detach() * 1024 ** -0.5).cuda().bfloat16()
    offs, rows = offs.cuda(), rows.cuda()
    dy = torch.randn(rows.shape[0], 768, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(OP(x, w, offs, rows), OP(x[rows], w, offs))
    dx, dw = BWD(dy, x, w, offs, rows)
    dxs, dw_ref = BWD(dy, x[rows], w, offs)
    assert torch.equal(dw, dw_ref)
    ref = torch.zeros(x.shape).index_add_(0, rows.cpu(), dxs.float().cpu()).bfloat16()
    assert torch.equal(dx.cpu(), ref)
    assert torch.equal(BWD(dy, x, w, offs, rows)[0], dx)


def test_cuda_combine_is_the_rows_summed_by_expert():
    """glm52::fp8_grouped_mm_combine on CUDA: its output is the FP8 op's rows weighted and added into their
    tokens in expert order, bit for bit (the CPU's sequential index_add in row order makes the same fp32 adds),
    twice the same bits; its three gradients match the CPU kernel's (fp32 fake quant) at bf16 level."""
    from tests.ops.test_grouped_mm import _combined
    x, w, offs, order, weight = _combined(T=2048, K=1024, N=768, k=4, E=9, seed=6)
    dy = torch.randn(2048, 768)
    xc, wc, oc, ordc, wtc = x.cuda().bfloat16(), w.cuda().bfloat16(), offs.cuda(), order.cuda(), weight.cuda()
    out = torch.ops.glm52.fp8_grouped_mm_combine(xc, wc, oc, ordc, wtc)
    rows = OP(xc, wc, oc).float().cpu()
    ref = torch.zeros(2048, 768).index_add_(0, order // 4, rows * weight.flatten()[order][:, None]).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out.cpu(), ref)
    assert torch.equal(torch.ops.glm52.fp8_grouped_mm_combine(xc, wc, oc, ordc, wtc), out)
    got = torch.ops.glm52.fp8_grouped_mm_combine_bwd(dy.cuda().bfloat16(), xc, wc, oc, ordc, wtc)
    want = torch.ops.glm52.fp8_grouped_mm_combine_bwd(dy, x, w, offs, order, weight)
    for g, r, what in zip(got, want, ("dx", "dw", "dweight")):
        assert_similar(g.float().cpu(), r, min_cos=0.9995, max_rel=0.03, what=what)


def test_cuda_pair_is_two_grouped_gemms_of_the_same_rows():
    """glm52::fp8_grouped_mm_pair on CUDA with ``rows``: both outputs and both weight gradients equal the single
    op's over the gathered copy bit for bit, and dx is their row gradients summed per token in fp32 in expert
    order (the CPU's sequential index_add of the two, in row order: the same adds)."""
    from tests.ops.test_grouped_mm import _routed
    x, w1, offs, rows = _routed(T=2048, K=1024, N=768, k=4, E=9, seed=4)
    x, w1 = x.detach().cuda().bfloat16(), (w1.detach() * 1024 ** -0.5).cuda().bfloat16()
    w2 = (torch.randn_like(w1.float()) * 1024 ** -0.5).bfloat16()
    offs, rows = offs.cuda(), rows.cuda()
    dy1, dy2 = (torch.randn(rows.shape[0], 768, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y1, y2 = torch.ops.glm52.fp8_grouped_mm_pair(x, w1, w2, offs, rows)
    assert torch.equal(y1, OP(x[rows], w1, offs)) and torch.equal(y2, OP(x[rows], w2, offs))
    dx, dw1, dw2 = torch.ops.glm52.fp8_grouped_mm_pair_bwd(dy1, dy2, x, w1, w2, offs, rows)
    (g1, ref1), (g2, ref2) = BWD(dy1, x[rows], w1, offs), BWD(dy2, x[rows], w2, offs)
    assert torch.equal(dw1, ref1) and torch.equal(dw2, ref2)
    summed = g1.float().cpu() + g2.float().cpu()
    assert torch.equal(dx.cpu(), torch.zeros(x.shape).index_add_(0, rows.cpu(), summed).bfloat16())
