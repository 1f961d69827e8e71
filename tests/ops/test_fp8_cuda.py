"""FP8 on CUDA: glm52::fp8_blockwise_mm runs the real blockwise torch._scaled_mm and matches the
dequantise-then-matmul reference computed on the CPU; the FP8 linear's three GEMMs match fp32."""
import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.fp8 import dequantize, fp8_linear, quantize_1x128, quantize_128x128, ref_fp8_linear
from tests.support.helpers import assert_similar

OP = torch.ops.glm52.fp8_blockwise_mm


@pytest.mark.parametrize("M,K,N", [(256, 512, 384), (4096, 4096, 4096)])
def test_blockwise_mm_cuda_vs_cpu_reference(M, K, N):
    x = torch.randn(M, K)
    w = torch.randn(N, K) * K ** -0.5
    a, sa = quantize_1x128(x)
    b, sb = quantize_128x128(w)
    ref = dequantize(a, sa) @ dequantize(b, sb).T                     # CPU, fp32
    got = OP(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_cuda
    # only the bf16 output rounding and accumulation order separate the two
    assert_similar(got.float().cpu(), ref, min_cos=0.99999, max_rel=5e-3, what="fp8 gemm (128x128)")
    b1, sb1 = quantize_1x128(w)                                       # 1x128 x 1x128 (wgrad form)
    ref1 = dequantize(a, sa) @ dequantize(b1, sb1).T
    got1 = OP(a.cuda(), sa.cuda(), b1.cuda(), sb1.cuda(), torch.bfloat16)
    assert_similar(got1.float().cpu(), ref1, min_cos=0.99999, max_rel=5e-3, what="fp8 gemm (1x128)")


def test_fp8_linear_cuda_grads_vs_fp32():
    M, K, N = 512, 1024, 768
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    y = fp8_linear(x, w)
    y.backward(dy)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (x32 @ w32.T).backward(dy.float())
    assert_similar(y.float(), (x32 @ w32.T).detach(), min_cos=0.998, max_rel=0.06, what="y")
    assert_similar(x.grad.float(), x32.grad, min_cos=0.998, max_rel=0.06, what="dx")
    assert_similar(w.grad.float(), w32.grad, min_cos=0.998, max_rel=0.06, what="dw")
    ref = ref_fp8_linear(x.detach().float().cpu(), w.detach().float().cpu())
    assert_similar(y.float().cpu(), ref.float(), min_cos=0.9999, max_rel=1e-2, what="y vs CPU fake-quant")
