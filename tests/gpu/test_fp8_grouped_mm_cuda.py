"""glm52::fp8_grouped_mm on CUDA: the cuBLASLt blockwise GEMMs per expert match the CPU fake-quant kernel
(only bf16 output rounding and accumulation order differ), and FP8 vs bf16 stays within the dense FP8
linears' error, forward and both gradients, with uneven and empty groups."""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.grouped_mm import ref_grouped_mm
from helpers import assert_similar

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
