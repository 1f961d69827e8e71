"""Tile-wise FP8 linear (DeepSeek-V3 recipe): ``glm52::fp8_blockwise_mm`` plus a traceable autograd path.

Quantisation (plain torch functions, called through the ``glm52::fp8_quantize`` op; e4m3, amax-based
scales, scale = amax / 448 is the DEquantisation multiplier, so ``x ~= x_fp8.float() * scale`` per tile):

* activations: 1x128 tiles along the reduction dim K -> ``a_fp8 [M, K]``, ``a_scale [M, K/128]`` fp32
* weights:     128x128 blocks                       -> ``b_fp8 [N, K]``, ``b_scale [N/128, K/128]`` fp32
* a second operand may also be 1x128 tiles (weight-gradient GEMM) -> ``b_scale [N, K/128]``

Dimensions that are not multiples of 128 are zero-padded by the quantisers (zeros add nothing to a
product); callers slice the result. The GEMM op computes ``dequant(a) @ dequant(b).T -> [M, N]``:

    glm52::fp8_blockwise_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype)

All scale tensors the op receives are logical, row-major, contiguous ``[rows, K/128]`` (or
``[N/128, K/128]``). Kernels convert to what their backend wants: the CUDA kernel below hands
``torch._scaled_mm`` ``b.T`` (column-major) and column-major scales, i.e. scale_a allocated as
``[K/128, M]`` and passed transposed; 128x128 scale_b as ``[N/128, K/128]`` passed transposed (K/128
padded to a multiple of 4 for cuBLASLt); 1x128 scale_b as ``[K/128, N]`` row-major.

The three GEMMs of a linear layer ``y = x @ w.T`` all run in FP8:

* forward  y  = x[1x128] @ w[128x128].T                         (M=tokens, K=in,  N=out)
* dgrad    dx = dy[1x128] @ (w.T)[128x128].T                     (the weight blocks, transposed)
* wgrad    dw = (dy.T)[1x128 along tokens] @ (x.T)[1x128 along tokens].T
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ._trace import announced

__all__ = ["FP8_DTYPE", "BLOCK", "quantize_1x128", "quantize_1x128_t", "quantize_128x128", "dequantize",
           "fp8_quantize", "fp8_blockwise_mm", "blockwise_scaled_mm", "fp8_linear", "ref_fp8_linear"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_EPS = 1e-12


def _pad_to(x: Tensor, dim: int, multiple: int) -> Tensor:
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    spec = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]
    return F.pad(x, spec)


# ---------------------------------------------------------------------------------------- quantisation
def quantize_1x128(x: Tensor) -> tuple[Tensor, Tensor]:
    """[M, K] -> (fp8 [M, Kp], fp32 scales [M, Kp/128]); Kp = K rounded up to 128, zero padded."""
    x = _pad_to(x, 1, BLOCK).contiguous()
    M, Kp = x.shape
    tiles = x.float().view(M, Kp // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=-1).clamp_min(_EPS) / FP8_MAX                   # [M, Kp/128]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, Kp), scale


def quantize_1x128_t(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise x.T in 1x128 tiles along x's rows: [M, K] -> (fp8 [K, Mp], fp32 scales [K, Mp/128]).

    Same result as ``quantize_1x128(x.t())`` (the weight-gradient operands: tiles along tokens)."""
    x = _pad_to(x, 0, BLOCK).contiguous()
    Mp, K = x.shape
    tiles = x.float().view(Mp // BLOCK, BLOCK, K)
    scale = tiles.abs().amax(dim=1).clamp_min(_EPS) / FP8_MAX                    # [Mp/128, K]
    q = (tiles / scale[:, None, :]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(Mp, K).t().contiguous(), scale.t().contiguous()


def quantize_128x128(w: Tensor) -> tuple[Tensor, Tensor]:
    """[..., N, K] -> (fp8 [..., Np, Kp], fp32 scales [..., Np/128, Kp/128]); both dims zero padded to 128.
    Leading dims are a batch (the experts of a grouped GEMM): blocks never straddle two of them."""
    w = _pad_to(_pad_to(w, -2, BLOCK), -1, BLOCK).contiguous()
    *lead, Np, Kp = w.shape
    blocks = w.float().view(*lead, Np // BLOCK, BLOCK, Kp // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(_EPS) / FP8_MAX              # [..., Np/128, Kp/128]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, Np, Kp), scale


def dequantize(x_fp8: Tensor, scale: Tensor) -> Tensor:
    """Inverse of either quantiser, chosen by the scale's shape; fp32 result."""
    R, Kp = x_fp8.shape
    kb = Kp // BLOCK
    x = x_fp8.float().view(R, kb, BLOCK)
    if scale.shape[0] == R:                                                       # 1x128 tiles
        return (x * scale[..., None]).view(R, Kp)
    blocks = x.view(R // BLOCK, BLOCK, kb, BLOCK)                                 # 128x128 blocks
    return (blocks * scale[:, None, :, None]).view(R, Kp)


# ---------------------------------------------------------------------------------------- quantise op
_QUANTISERS = {"1x128": quantize_1x128, "1x128_t": quantize_1x128_t, "128x128": quantize_128x128}


@torch.library.custom_op("glm52::fp8_quantize", mutates_args=())
def fp8_quantize(x: Tensor, tiles: str) -> tuple[Tensor, Tensor]:
    """Quantise a 2-D tensor: tiles "1x128" (rows, along K), "1x128_t" (x.T, along x's rows) or
    "128x128" (blocks). Returns (fp8 data, fp32 dequantisation scales), both contiguous.

    An op rather than inline torch because inductor's CPU codegen fuses the recomputed forward
    quantisation with the weight-gradient one (same input, one transposed) into a pointwise kernel
    whose loop split fails an internal assertion (torch 2.13, cpp.py try_loop_split); as an op it is
    one opaque call under every backend. Faster device kernels can be registered on it.
    """
    return _fp8_quantize_kernel(x, tiles)


def _fp8_quantize_kernel(x: Tensor, tiles: str) -> tuple[Tensor, Tensor]:
    """The op's PyTorch kernel (any device)."""
    torch._check(tiles in _QUANTISERS,
                 lambda: f"fp8_quantize: tiles={tiles!r}, expected one of {list(_QUANTISERS)}")
    q, s = _QUANTISERS[tiles](x)
    return q.contiguous(), s.contiguous()


@fp8_quantize.register_fake
@announced("glm52::fp8_quantize")
def _(x, tiles):
    return _quantized_like(x, tiles)


def _quantized_like(x: Tensor, tiles: str) -> tuple[Tensor, Tensor]:
    """Empty (fp8 data, fp32 scales) of the shapes ``fp8_quantize(x, tiles)`` returns."""
    torch._check(tiles in _QUANTISERS,
                 lambda: f"fp8_quantize: tiles={tiles!r}, expected one of {list(_QUANTISERS)}")
    up = lambda n: (n + BLOCK - 1) // BLOCK * BLOCK                               # noqa: E731
    R, K = x.shape
    if tiles == "1x128":
        shape, sshape = (R, up(K)), (R, up(K) // BLOCK)
    elif tiles == "1x128_t":
        shape, sshape = (K, up(R)), (K, up(R) // BLOCK)
    else:
        shape, sshape = (up(R), up(K)), (up(R) // BLOCK, up(K) // BLOCK)
    return x.new_empty(shape, dtype=FP8_DTYPE), x.new_empty(sshape, dtype=torch.float32)


@torch.library.custom_op("glm52::fp8_quantize_pair", mutates_args=())
def fp8_quantize_pair(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``fp8_quantize(x, "1x128")`` and ``fp8_quantize(x, "1x128_t")`` as one op: the forward GEMM's operand and
    the weight gradient's, computed together in the forward. The second is what the backward keeps in x's place
    (about half of its bytes), and a compiled graph can keep it: the op's first outputs feed the forward, so the
    partitioner cannot move the op to the backward (a value only the backward reads is never saved)."""
    return (*_quant(x, "1x128"), *_quant(x, "1x128_t"))


@fp8_quantize_pair.register_fake
@announced("glm52::fp8_quantize_pair")
def _(x):
    return (*_quantized_like(x, "1x128"), *_quantized_like(x, "1x128_t"))


def _quant(x: Tensor, tiles: str) -> tuple[Tensor, Tensor]:
    return torch.ops.glm52.fp8_quantize(x, tiles)


# ---------------------------------------------------------------------------------------- GEMM op
def _check(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor) -> None:
    torch._check(a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE,
                 lambda: f"fp8_blockwise_mm: a and b must be {FP8_DTYPE}, got {a.dtype}, {b.dtype}")
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
                 lambda: f"fp8_blockwise_mm: a [M, K] and b [N, K] needed, got {tuple(a.shape)}, {tuple(b.shape)}")
    torch._check(a.shape[1] % BLOCK == 0, lambda: f"fp8_blockwise_mm: K={a.shape[1]} must be a multiple of 128")
    kb = a.shape[1] // BLOCK
    torch._check(a_scale.shape == (a.shape[0], kb),
                 lambda: f"fp8_blockwise_mm: a_scale must be [M, K/128]=({a.shape[0]}, {kb}), got {tuple(a_scale.shape)}")
    torch._check(b_scale.dim() == 2 and b_scale.shape[1] == kb,
                 lambda: f"fp8_blockwise_mm: b_scale must be [N/128 or N, K/128={kb}], got {tuple(b_scale.shape)}")
    torch._check(a_scale.dtype == torch.float32 and b_scale.dtype == torch.float32,
                 lambda: "fp8_blockwise_mm: scales must be float32")


@torch.library.custom_op("glm52::fp8_blockwise_mm", mutates_args=())
def fp8_blockwise_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """dequant(a) @ dequant(b).T -> [M, N] in out_dtype. Reference kernel: dequantise, fp32 matmul."""
    _check(a, a_scale, b, b_scale)
    return (dequantize(a, a_scale) @ dequantize(b, b_scale).T).to(out_dtype)


@fp8_blockwise_mm.register_fake
def _(a, a_scale, b, b_scale, out_dtype):
    _check(a, a_scale, b, b_scale)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@register_flop_formula(torch.ops.glm52.fp8_blockwise_mm)
def _fp8_mm_flops(a_shape, a_scale_shape, b_shape, b_scale_shape, out_dtype, *args, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[0]


@torch.library.register_kernel("glm52::fp8_blockwise_mm", "cuda")
def _fp8_blockwise_mm_cuda(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
                           out_dtype: torch.dtype) -> Tensor:
    _check(a, a_scale, b, b_scale)
    return blockwise_scaled_mm(a, a_scale, b, b_scale, out_dtype)


def blockwise_scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype,
                        out: Tensor | None = None) -> Tensor:
    """sm90 blockwise ``torch._scaled_mm`` on checked CUDA operands: mat2 = b.T (column-major), column-major
    scales (the layouts in the module docstring); ``out`` [M, N] (e.g. rows of a larger contiguous tensor) is
    written in place."""
    N = b.shape[0]
    b_blocks = b_scale.shape[0] != N                         # 128x128 blocks, else 1x128 tiles
    kb = a.shape[1] // BLOCK
    if b_blocks and kb % 4:                                 # cuBLASLt wants K/128 % 4 == 0 for 128x128
        extra = (-kb) % 4
        a = F.pad(a.view(torch.uint8), (0, extra * BLOCK)).view(FP8_DTYPE)
        b = F.pad(b.view(torch.uint8), (0, extra * BLOCK)).view(FP8_DTYPE)
        a_scale = F.pad(a_scale, (0, extra), value=1.0)
        b_scale = F.pad(b_scale, (0, extra), value=1.0)
    scale_a = a_scale.t().contiguous().t()                  # [M, K/128], stored as [K/128, M]
    if b_blocks:
        scale_b = b_scale.contiguous().t()                  # [K/128, N/128], stored as [N/128, K/128]
    else:
        scale_b = b_scale.t().contiguous()                  # [K/128, N], row-major
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=out_dtype, out=out)


# ---------------------------------------------------------------------------------------- autograd
def _mm(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], out_dtype: torch.dtype) -> Tensor:
    return torch.ops.glm52.fp8_blockwise_mm(a[0], a[1], b[0], b[1], out_dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x @ w.T with the forward, dgrad and wgrad GEMMs all in FP8. x: [M, K], w: [N, K].

    The weight gradient's operand, x.T quantised in 1x128 tiles along the tokens, is computed in the forward
    (``wgrad``) and saved instead of x: the backward reads exactly what it would have computed from x, at about
    half of x's bytes (one e4m3 byte per element and an fp32 scale per 128)."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, wgrad: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        N = w.shape[0]
        if wgrad:  # x in 1x128 tiles [M, Kp], and x.T in 1x128 tiles [K, Mp] for the weight gradient
            xq, xs, xt_q, xt_s = torch.ops.glm52.fp8_quantize_pair(x)
        else:
            (xq, xs), xt_q, xt_s = _quant(x, "1x128"), None, None
        y = _mm((xq, xs), _quant(w, "128x128"), x.dtype)                          # [M, Np]
        return y[:, :N], xt_q, xt_s

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, _ = inputs
        _, xt_q, xt_s = output
        ctx.mark_non_differentiable(*(t for t in (xt_q, xt_s) if t is not None))
        ctx.save_for_backward(xt_q, xt_s, w)
        ctx.in_features = x.shape[1]

    @staticmethod
    def backward(ctx, dy: Tensor, *_unused):
        xt_q, xt_s, w = ctx.saved_tensors
        K = ctx.in_features
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_q, w_s = _quant(w, "128x128")                                        # [Np, Kp], [Np/128, Kp/128]
            wt = (w_q.t().contiguous(), w_s.t().contiguous())                     # blocks of w.T = blocks.T
            dx = _mm(_quant(dy, "1x128"), wt, dy.dtype)[:, :K]                    # [M, K]
        if ctx.needs_input_grad[1]:
            dyt = _quant(dy, "1x128_t")                                           # [N, Mp] tiles along tokens
            dw = _mm(dyt, (xt_q, xt_s), w.dtype)                                  # [N, K]
        return dx, dw, None


def fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` with tile-wise FP8 GEMMs; x is [..., K], weight [N, K]. No bias."""
    wgrad = torch.is_grad_enabled() and weight.requires_grad
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), weight, wgrad)[0]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def ref_fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Fake-quant reference in plain fp32: quantise/dequantise both operands, then matmul."""
    x2 = x.reshape(-1, x.shape[-1])
    K, N = x2.shape[1], weight.shape[0]
    xd = dequantize(*quantize_1x128(x2))[:, :K]
    wd = dequantize(*quantize_128x128(weight))[:N, :K]
    return (xd @ wd.T).to(x.dtype).view(*x.shape[:-1], N)
