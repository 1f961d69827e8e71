"""How the TileLang top-k op cuts its rows into chunks (`dsa_topk_tl.plan_chunks` / `_op_chunks`, on the CPU):
every row in exactly one chunk, in order; each chunk's logits buffer within the budget and as wide as its rows'
ends; and the area plan of a causal row range in about half the chunks of the full-width one."""
import pytest
import torch

tl = pytest.importorskip("glm52_model.ops.cuda.dsa_topk_tl", reason="TileLang not installed (pip install '.[cuda]')")


def _check_cover(chunks, S, Skp, block_Q, budget, ends):
    assert chunks[0][0] == 0 and chunks[-1][1] == S
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), f"chunks not contiguous: {chunks}"
    for r0, r1, kend in chunks:
        assert r0 < r1 and r0 % block_Q == 0 and kend % tl.BLOCK_N == 0 and 0 < kend <= Skp
        n_pad = -(-(r1 - r0) // block_Q) * block_Q
        assert n_pad * kend * 4 <= budget or (r1 - r0 <= max(block_Q, tl.PLAN_GROUP)), (r0, r1, kend)
        assert int(ends[r0:r1].max()) <= kend, f"rows {r0}:{r1} end past their buffer's {kend} keys"


@pytest.mark.parametrize("S,budget", [(65536, 2 << 30), (131072, 2 << 30), (131072, 4 << 30), (20000, 64 << 20)])
def test_area_plan_of_causal_rows_halves_the_chunks(S, budget):
    Skp = -(-S // tl.BLOCK_N) * tl.BLOCK_N
    ends = torch.arange(1, S + 1, dtype=torch.int32)
    with torch.no_grad():
        rows = tl.plan_chunks(S, Skp, 4, budget)
        with_plan = lambda plan: _op_chunks(S, Skp, 4, ends, plan, budget)  # noqa: E731
        area = with_plan("area")
    assert with_plan("rows") == rows and all(kend == Skp for _, _, kend in rows)
    _check_cover(rows, S, Skp, 4, budget, ends)
    _check_cover(area, S, Skp, 4, budget, ends)
    # a causal triangle is half the rectangle: about half the chunks (each but the last nearly full)
    assert len(area) <= len(rows) // 2 + 2, (len(area), len(rows))
    used = sum(-(-(r1 - r0) // 4) * 4 * kend * 4 for r0, r1, kend in area[:-1]) / (budget * (len(area) - 1))
    assert used > 0.9, f"area chunks fill {used:.3f} of their budget"


def _op_chunks(S, Skp, block_Q, ends, plan, budget):
    from unittest import mock
    with mock.patch.object(tl, "LAUNCH_TUNABLES", tl.LAUNCH_TUNABLES | {"plan": plan}), \
            mock.patch.object(tl, "LOGITS_BUDGET_BYTES", budget):
        return tl._op_chunks(S, Skp, block_Q, ends)


@pytest.mark.parametrize("block_Q", [4, 16, 42])
def test_area_plan_of_any_ends(block_Q):
    """Ends in any order (packed documents, rows reaching every key, empty rows): each chunk is as wide as the
    largest end among its rows and the rows before, within the budget."""
    g = torch.Generator().manual_seed(0)
    S, Sk = 9000, 7000
    Skp = -(-Sk // tl.BLOCK_N) * tl.BLOCK_N
    ends = torch.randint(0, Sk + 1, (S,), generator=g, dtype=torch.int32)
    ends[:3000] = torch.arange(3000, dtype=torch.int32) // 3          # a slow causal start
    ends[5000:5100] = 0                                               # empty rows
    budget = 1000 * Skp * 4 // 3
    area = _op_chunks(S, Skp, block_Q, ends, "area", budget)
    _check_cover(area, S, Skp, block_Q, budget, ends)
    assert area[0][2] < Skp and len(area) < len(tl.plan_chunks(S, Skp, block_Q, budget))


def test_plan_with_a_budget_below_one_block_takes_one_block_a_chunk():
    """A full-width row of 2^20 keys is 4 MiB, a 1 MiB budget less than one block of them: the rows plan takes
    one block a chunk; the area plan, whose rows end within their first 1000 keys, a few hundred rows a chunk."""
    S, Skp, budget = 1000, 1 << 20, 1 << 20
    rows = tl.plan_chunks(S, Skp, 4, budget)
    assert [(r0, r1) for r0, r1, _ in rows] == [(r, r + 4) for r in range(0, S, 4)]
    ends = torch.arange(1, S + 1, dtype=torch.int32)
    area = _op_chunks(S, Skp, 4, ends, "area", budget)
    _check_cover(area, S, Skp, 4, budget, ends)
    assert [r1 - r0 for r0, r1, _ in area][:3] == [512, 292, 196] and len(area) == 3   # 512 x 512 x 4 B = 1 MiB


def test_unknown_plan_is_refused():
    with pytest.raises(AssertionError, match="plan must be one of"):
        _op_chunks(1000, 1 << 20, 4, torch.arange(1, 1001, dtype=torch.int32), "triangle", 1 << 20)
