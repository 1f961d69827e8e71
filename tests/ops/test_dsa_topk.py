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


# ------------------------------------------------------------------------------------------ FP8 logits
def _fp8_near_tie_check(ids_fp8, q, k, w, starts, ends, topk, scale):
    """Where the FP8 answer differs from the exact one, it is a near-tie: every key the FP8 logits chose
    scores (exactly) within twice the row's largest FP8 score error of the exact k-th best. Returns the
    mean ID-set overlap with the exact answer."""
    exact = ref_dsa_scores(q, k, w, starts, ends, scale)                          # [S, Sk] fp32
    q8, k8, w8, ks = dsa_topk.quantize_indexer(q, k, w)
    approx = ref_dsa_scores(q8.float(), k8.float() * ks[:, None], w8, starts, ends, scale)
    finite = torch.isfinite(exact)
    err = torch.where(finite, (approx - exact).abs(), 0.0).amax(1)                # per row
    ref = ref_dsa_topk_indices(q, k, w, starts, ends, topk, scale)
    kth = torch.gather(exact, 1, ref.long().clamp_min(0)).masked_fill(ref < 0, float("inf")).amin(1)
    chosen = torch.gather(exact, 1, ids_fp8.long().clamp_min(0)).masked_fill(ids_fp8 < 0, float("inf")).amin(1)
    assert bool((chosen >= kth - 2 * err - 1e-6).all()), "an FP8 choice that is not a near-tie"
    torch.testing.assert_close(ids_fp8 == -1, ref == -1)
    return float(dsa_topk.id_overlap(ids_fp8, ref).mean())


def test_fp8_logits_agree_with_the_exact_top_k_except_near_ties():
    """The e4m3 indexer (q and k quantised, one scale per 128-wide row) against exact fp32 scores: ID sets
    overlap >= 90% here (random scores are dense near the k-th; trained ones are not) and every difference is
    a near-tie. Numbers: tests print nothing; benchmarks/bench_kernels.py reports the H200 overlap."""
    q, k, w, starts, ends = _inputs(S=256, H=4, D=128, cu=(0, 100, 256))
    q8, k8, w8, ks = dsa_topk.quantize_indexer(q, k, w)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and ks.shape == (256,) and w8.shape == w.shape
    ids = OP(q8, k8, w8, starts, ends, 32, 128 ** -0.5, k_scale=ks)
    overlap = _fp8_near_tie_check(ids, q, k, w, starts, ends, 32, 128 ** -0.5)
    assert overlap >= 0.9, overlap
    assert overlap < 1.0                     # FP8 really changed the scores (the test would see a no-op)


def test_fp8_inputs_are_checked():
    q, k, w, starts, ends = _inputs(S=16, H=2, D=128, cu=(0, 16))
    q8, k8, w8, ks = dsa_topk.quantize_indexer(q, k, w)
    with pytest.raises(RuntimeError, match="FP8 logits take float8_e4m3fn q and k and a k_scale"):
        OP(q8, k, w8, starts, ends, 4, 1.0, k_scale=ks)
    with pytest.raises(RuntimeError, match="quantize_indexer"):
        OP(q8, k8, w8, starts, ends, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"k_scale must be float32 \[Sk=16\]"):
        OP(q8, k8, w8, starts, ends, 4, 1.0, k_scale=ks[:8])
    with pytest.raises(ValueError, match="got head dim 32; use index_head_dim=128"):
        dsa_topk.quantize_indexer(*_inputs(S=8, H=2, D=32)[:3])
    # fake vs real (opcheck's other utils multiply inputs, which float8 has no CPU kernel for)
    torch.library.opcheck(OP, (q8, k8, w8, starts, ends, 4, 1.0), {"k_scale": ks}, test_utils="test_faketensor")


@pytest.mark.slow
def test_fp8_indexer_in_the_model_keeps_the_same_op_and_must_save():
    """GLM52Config(fp8_indexer=True): the same glm52::dsa_topk_indices runs on e4m3 inputs; compiled with
    sacpass the backward re-runs it 0 times; a head dim other than 128 is refused."""
    import sacpass
    from glm52_model import GLM52Config, GLM52ForCausalLM
    from glm52_model.compile import apply_compile

    with pytest.raises(ValueError, match="fp8_indexer needs index_head_dim=128"):
        GLM52Config.tiny(fp8_indexer=True, index_head_dim=64, qk_rope_head_dim=32)
    torch.manual_seed(0)
    cfg = GLM52Config.tiny(fp8_indexer=True, num_layers=2, mtp_layers=0)
    model = GLM52ForCausalLM(cfg)
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is OP.default:
                seen.append((args[0].dtype, args[1].dtype, (kwargs or {}).get("k_scale", args[7] if len(args) > 7 else None) is not None))
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    with Spy():                                                                  # eager: what the op receives
        model(ids, labels=ids)
    assert len(seen) == 2 and all(s == (torch.float8_e4m3fn, torch.float8_e4m3fn, True) for s in seen), seen
    apply_compile(model, backend=sacpass.backend(inner="aot_eager"))
    with OpCounter(OP) as calls:
        model(ids, labels=ids).backward()
    assert calls.backward == 0 and calls.forward == 2


def test_deterministic_algorithms_run_the_pytorch_kernel_instead_of_the_select_with_gathered_ties(monkeypatch):
    """The TileLang select gives ties at the k-th score, on its radix paths, to the keys its atomics gathered first;
    under torch.use_deterministic_algorithms the CUDA kernel runs the PyTorch one (torch.topk, deterministic),
    with a warning that says why. Called here on CPU tensors, which the launcher
    otherwise hands to the TileLang kernels."""
    pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")
    from glm52_model.ops.cuda import dsa_topk_tl as tl

    q, k, w, starts, ends = _inputs(S=40, H=32, D=128, cu=(0, 40), dtype=torch.bfloat16)

    def picked(*args, **kwargs):
        raise LookupError("the TileLang kernels were picked")
    monkeypatch.setattr(tl, "op_kernels", picked)
    with pytest.raises(LookupError, match="TileLang kernels were picked"):
        tl.dsa_topk_indices_tl(q, k, w, starts, ends, 16, 0.5)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.warns(UserWarning, match="use_deterministic_algorithms is on.*ties at the k-th score"):
            ids = tl.dsa_topk_indices_tl(q, k, w, starts, ends, 16, 0.5)
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(ids, dsa_topk._dsa_topk_kernel(q, k, w, starts, ends, 16, 0.5))
