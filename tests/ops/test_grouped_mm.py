import pytest
"""glm52::grouped_mm (MoE experts): opcheck and a per-expert matmul loop reference, grads too."""
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.grouped_mm import ref_grouped_mm

OP = torch.ops.glm52.grouped_mm


def _inputs():
    x = torch.randn(40, 32, requires_grad=True)
    w = torch.randn(4, 32, 24, requires_grad=True)
    offs = torch.tensor([7, 7, 30, 40], dtype=torch.int32)                      # expert 1 gets no rows
    return x, w, offs


def test_matches_loop_reference():
    x, w, offs = _inputs()
    dy = torch.randn(40, 24)
    OP(x, w, offs).backward(dy)
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    y2 = ref_grouped_mm(x2, w2, offs)
    y2.backward(dy)
    torch.testing.assert_close(OP(x, w, offs), y2)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert bool((w.grad[1] == 0).all())


def test_opcheck():
    x, w, offs = _inputs()
    torch.library.opcheck(OP, (x, w, offs))
    torch.library.opcheck(torch.ops.glm52.grouped_mm_bwd, (torch.randn(40, 24), x.detach(), w.detach(), offs))


@pytest.mark.parametrize("offs", [[2, 5, 7], [0, 3, 3], [1, 1, 6]])
def test_backward_uneven_groups(offs):
    """Groups of any size (7 rows, empty experts, rows past offs[-1]): the weight-gradient GEMM reads x.T
    grouped along its columns, which _grouped_mm needs 16-byte aligned (was an error on CPU and CUDA)."""
    x = torch.randn(7, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    offs = torch.tensor(offs, dtype=torch.int32)
    torch.ops.glm52.grouped_mm(x, w, offs).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref_grouped_mm(x2, w2, offs).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)


def _routing(T, k, E, seed):
    """Top-k routing of T tokens over E experts, the first expert left empty: the assignments sorted by expert
    (``order``; a token picks an expert at most once) and the int32 group ends."""
    g = torch.Generator().manual_seed(seed)
    expert = torch.stack([torch.randperm(E - 1, generator=g)[:k] + 1 for _ in range(T)])  # [T, k], never 0
    counts = torch.bincount(expert.flatten(), minlength=E)
    return torch.argsort(expert.flatten(), stable=True), counts.cumsum(0).to(torch.int32)


def _routed(T=12, K=32, N=24, k=2, E=4, seed=0):
    """Token rows x [T, K], expert weights, group ends and ``rows``, the token of each sorted assignment."""
    order, offs = _routing(T, k, E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, K, generator=g, requires_grad=True)
    w = torch.randn(E, K, N, generator=g, requires_grad=True)
    return x, w, offs, order // k


def test_gathered_rows_equal_gathering_first():
    """With ``rows``, y is grouped_mm over x[rows] and dx sums each token's rows (tokens read by 2 experts)."""
    x, w, offs, rows = _routed()
    dy = torch.randn(rows.shape[0], 24)
    y = OP(x, w, offs, rows)
    y.backward(dy)
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    y2 = ref_grouped_mm(x2, w2, offs, rows)
    y2.backward(dy)
    assert y.shape == (24, 24) and x.grad.shape == x.shape
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert bool((w.grad[0] == 0).all())
    torch.library.opcheck(OP, (x, w, offs, rows))
    torch.library.opcheck(torch.ops.glm52.grouped_mm_bwd, (dy, x.detach(), w.detach(), offs, rows))


def test_rows_must_be_integers():
    x, w, offs, rows = _routed()
    with pytest.raises(RuntimeError, match=r"grouped_mm: rows must be int32 or int64 \[R\]"):
        OP(x, w, offs, rows.float())
    with pytest.raises(RuntimeError, match=r"grouped_mm: rows must be int32 or int64 \[R\]"):
        OP(x, w, offs, rows.view(2, -1))


def test_flops_count_the_gathered_rows():
    from torch.utils.flop_counter import FlopCounterMode
    x, w, offs, rows = _routed()
    with FlopCounterMode(display=False) as fc:
        OP(x, w, offs, rows).sum().backward()
    assert fc.get_total_flops() == 6 * 24 * 32 * 24                             # R = 24 rows, not T = 12


COMBINE = torch.ops.glm52.grouped_mm_combine


def _combined(T=40, K=64, N=48, k=2, E=5, seed=0):
    """Hidden rows x [T*k, K] of the assignments sorted by expert (``order``), expert weights, group ends and
    routing weights [T, k]."""
    order, offs = _routing(T, k, E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T * k, K, generator=g)
    w = torch.randn(E, K, N, generator=g) * K ** -0.5
    return x, w, offs, order, torch.rand(T, k, generator=g)


def _unfused(x, w, offs, order, weight):
    """The same sum the long way: every row's output, read back by token and summed over k (differentiable)."""
    from glm52_model.model import combine_experts
    return combine_experts(ref_grouped_mm(x, w, offs), weight, order)


def against_unfused(op, bwd, **shape):
    """``op`` (a combine op, ``bwd`` its backward) and the rows-then-gather path on one routing, forward and
    backward: (out, ref, [(got, want, name)] for dx, dw and dweight, the inputs (x, w, offs, order, weight) and the
    gradient dy); the op's forward and backward pass opcheck there."""
    x, w, offs, order, weight = _combined(**shape)
    x, w, weight = (t.requires_grad_() for t in (x, w, weight))
    dy = torch.randn(weight.shape[0], w.shape[2], generator=torch.Generator().manual_seed(7))
    out = op(x, w, offs, order, weight)
    out.backward(dy)
    x2, w2, weight2 = (t.detach().requires_grad_() for t in (x, w, weight))
    ref = _unfused(x2, w2, offs, order, weight2)
    ref.backward(dy)
    torch.library.opcheck(op, (x, w, offs, order, weight))
    torch.library.opcheck(bwd, (dy, x.detach(), w.detach(), offs, order, weight.detach()))
    grads = [(x.grad, x2.grad, "dx"), (w.grad, w2.grad, "dw"), (weight.grad, weight2.grad, "dweight")]
    return out, ref, grads, (x, w, offs, order, weight), dy


def test_combine_is_the_rows_summed_into_their_tokens():
    """out[t] = sum_j weight[t, j] * y[row of assignment t*k + j], with its gradients (dweight too) against the
    rows-then-gather path; an empty expert gets dw = 0."""
    out, ref, grads, (x, w, *_), _ = against_unfused(COMBINE, torch.ops.glm52.grouped_mm_combine_bwd)
    assert out.shape == (40, 48)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want, what in grads:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")
    assert bool((w.grad[0] == 0).all())


def test_combine_is_as_close_to_float64_as_the_gather():
    """The fused sum adds by expert and takes dweight as <hidden row, its dgrad> (no output rows kept): in fp32
    its output and routing-weight gradient are as close to float64 as the rows-then-gather path (within 2x)."""
    x, w, offs, order, weight = _combined(T=64, K=128, N=96, k=4, E=9, seed=5)
    dy = torch.randn(64, 96, generator=torch.Generator().manual_seed(9))

    def run(fused, dtype):
        xx, ww, wt = x.to(dtype), w.to(dtype), weight.to(dtype).requires_grad_()
        out = COMBINE(xx, ww, offs, order, wt) if fused else _unfused(xx, ww, offs, order, wt)
        out.backward(dy.to(dtype))
        return out.detach().double(), wt.grad.double()

    out64, dweight64 = run(False, torch.float64)
    (out_f, dw_f), (out_g, dw_g) = run(True, torch.float32), run(False, torch.float32)
    assert (out_f - out64).abs().max() <= 2 * (out_g - out64).abs().max() + 1e-7
    assert (dw_f - dweight64).abs().max() <= 2 * (dw_g - dweight64).abs().max() + 1e-7


def test_combine_names_bad_inputs():
    x, w, offs, order, weight = _combined()
    with pytest.raises(RuntimeError, match=r"grouped_mm_combine: weight must be a float \[T, k\]"):
        COMBINE(x, w, offs, order, weight.flatten())
    with pytest.raises(RuntimeError, match=r"grouped_mm_combine: order must be int32 or int64 \[R = T \* k\]"):
        COMBINE(x, w, offs, order[:-1], weight)
    with pytest.raises(RuntimeError, match=r"grouped_mm_combine: order must be int32 or int64"):
        COMBINE(x, w, offs, order.float(), weight)


def test_combine_flops_count_every_row():
    from torch.utils.flop_counter import FlopCounterMode
    x, w, offs, order, weight = _combined()
    with FlopCounterMode(display=False) as fc:
        COMBINE(x.requires_grad_(), w, offs, order, weight).sum().backward()
    assert fc.get_total_flops() == 6 * 80 * 64 * 48


def test_pair_is_two_grouped_gemms_of_the_same_rows():
    """glm52::grouped_mm_pair equals grouped_mm twice over the same gathered rows, outputs and all gradients;
    its FLOPs are both GEMMs'."""
    from torch.utils.flop_counter import FlopCounterMode
    x, w1, offs, rows = _routed()
    w2 = torch.randn_like(w1).requires_grad_()
    dy1, dy2 = torch.randn(24, 24), torch.randn(24, 24)
    with FlopCounterMode(display=False) as fc:
        y1, y2 = torch.ops.glm52.grouped_mm_pair(x, w1, w2, offs, rows)
        torch.autograd.backward((y1, y2), (dy1, dy2))
    assert fc.get_total_flops() == 2 * 6 * 24 * 32 * 24
    x2, w12, w22 = (t.detach().requires_grad_() for t in (x, w1, w2))
    r1, r2 = ref_grouped_mm(x2, w12, offs, rows), ref_grouped_mm(x2, w22, offs, rows)
    torch.autograd.backward((r1, r2), (dy1, dy2))
    torch.testing.assert_close(y1, r1)
    torch.testing.assert_close(y2, r2)
    for got, want in ((x.grad, x2.grad), (w1.grad, w12.grad), (w2.grad, w22.grad)):
        torch.testing.assert_close(got, want)
    torch.library.opcheck(torch.ops.glm52.grouped_mm_pair, (x, w1, w2, offs, rows))
    torch.library.opcheck(torch.ops.glm52.grouped_mm_pair_bwd,
                          (dy1, dy2, x.detach(), w1.detach(), w2.detach(), offs, rows))
