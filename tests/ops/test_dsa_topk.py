"""glm52::dsa_topk_indices: opcheck, chunked kernel vs the naive dense reference, padding, run counts."""
import pytest
import torch

import glm52_model.ops  # noqa: F401  (registers the ops)
from glm52_model.ops import dsa_topk
from glm52_model.ops.dsa_topk import ref_dsa_scores, ref_dsa_topk_indices
from sacpass.testing import OpCounter

OP = torch.ops.glm52.dsa_topk_indices


def _inputs(S=48, H=4, D=32, cu=(0, 20, 48), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, D, generator=g).to(dtype)
    k = torch.randn(S, D, generator=g).to(dtype)
    w = torch.randn(S, H, generator=g)
    cu_t = torch.tensor(cu)
    seq = torch.searchsorted(cu_t[1:], torch.arange(S), right=True)
    starts = cu_t[seq].to(torch.int32)
    ends = (torch.arange(S) + 1).to(torch.int32)                                 # causal, packed
    return q, k, w, starts, ends


def _check_against_ref(ids, q, k, w, starts, ends, topk, scale):
    """Same selected scores (ties may pick different IDs) and the same -1 padding."""
    ref = ref_dsa_topk_indices(q, k, w, starts, ends, topk, scale)
    assert ids.dtype == torch.int32 and ids.is_contiguous() and ids.shape == ref.shape
    torch.testing.assert_close(ids == -1, ref == -1)
    score = ref_dsa_scores(q, k, w, starts, ends, scale)
    pick = lambda i: torch.gather(score, 1, i.long().clamp_min(0)).masked_fill(i < 0, 0.0)
    torch.testing.assert_close(pick(ids), pick(ref), rtol=1e-5, atol=1e-5)
    # sorted descending where valid
    got = pick(ids).masked_fill(ids < 0, float("-inf"))
    assert bool((got[:, :-1] >= got[:, 1:]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [8, 64])  # 64 > keys of every query: -1 padding everywhere
def test_matches_reference(dtype, topk):
    q, k, w, starts, ends = _inputs(dtype=dtype)
    ids = OP(q, k, w, starts, ends, topk, 0.125)
    _check_against_ref(ids, q, k, w, starts, ends, topk, 0.125)
    # Query i of the second sequence (start 20) has exactly i - 20 + 1 valid keys.
    assert int((ids[25] >= 0).sum()) == min(topk, 6)
    assert bool(((ids[25][ids[25] >= 0] >= 20) & (ids[25][ids[25] >= 0] <= 25)).all())


def test_chunking_is_invisible(monkeypatch):
    q, k, w, starts, ends = _inputs(S=40, cu=(0, 40))
    full = OP(q, k, w, starts, ends, 16, 1.0)
    monkeypatch.setattr(dsa_topk, "_CHUNK_ELEMENTS", 7 * 4 * 40)                    # 7-row chunks
    torch.testing.assert_close(OP(q, k, w, starts, ends, 16, 1.0), full)


def test_requires_grad_inputs_and_run_count():
    q, k, w, starts, ends = _inputs()
    q.requires_grad_(), k.requires_grad_(), w.requires_grad_()
    with OpCounter(OP) as topk:
        ids = OP(q, k, w, starts, ends, 8, 0.5)
        assert not ids.requires_grad and topk.forward == 1
        with torch.no_grad():
            OP(q, k, w, starts, ends, 8, 0.5)
    assert (topk.forward, topk.backward) == (2, 0)


def test_opcheck():
    q, k, w, starts, ends = _inputs(S=24, cu=(0, 10, 24))
    torch.library.opcheck(OP, (q, k, w, starts, ends, 8, 0.125))
    torch.library.opcheck(OP, (q.bfloat16(), k.bfloat16(), w, starts, ends, 32, 1.0))


def test_registered_must_save():
    import sacpass
    assert any("dsa_topk_indices" in str(s) for s in sacpass.registered_must_save())
