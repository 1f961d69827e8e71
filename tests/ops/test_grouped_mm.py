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


def _routed(T=12, K=32, N=24, k=2, E=4, seed=0):
    """Top-k routing of T tokens over E experts: the assignments sorted by expert, ``rows`` the token of each
    (a token picks an expert at most once), and the first expert left empty."""
    g = torch.Generator().manual_seed(seed)
    expert = torch.stack([torch.randperm(E - 1, generator=g)[:k] + 1 for _ in range(T)])  # [T, k], never 0
    order = torch.argsort(expert.flatten(), stable=True)
    counts = torch.bincount(expert.flatten(), minlength=E)
    x = torch.randn(T, K, generator=g, requires_grad=True)
    w = torch.randn(E, K, N, generator=g, requires_grad=True)
    return x, w, counts.cumsum(0).to(torch.int32), order // k


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
