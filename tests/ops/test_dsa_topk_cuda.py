"""CUDA (TileLang) kernel of glm52::dsa_topk_indices vs the PyTorch reference.

The kernel's scores are the same bf16 products summed in fp32 in another order, so scores may differ
from the reference's by a few fp32 ulps; IDs must agree except where two candidates' scores are within
SCORE_TOL of each other at the selection boundary (ties). The tie test counts those differences.
"""
import dataclasses

import pytest
import torch

import glm52_model.ops  # noqa: F401
from glm52_model.ops.dsa_topk import _dsa_topk_kernel, ref_dsa_scores

tl_ops = pytest.importorskip("glm52_model.ops.cuda.dsa_topk_tl", reason="TileLang not installed")
from glm52_model.ops.cuda import _common, topk_select_tl  # noqa: E402
from glm52_model.ops.cuda.dsa_topk_tl import LogitsConfig, TopkConfig  # noqa: E402
from glm52_model.ops.cuda.topk_select_tl import SelectConfig  # noqa: E402
SCORE_TOL = 1e-4  # relative to the row's score scale
# The H200's FP8 tensor cores accumulate with about 14 mantissa bits (DeepSeek-V3 report, sec. 3.3.2), so e4m3
# logits differ from their fp32 math by up to ~2^-14 of each head's sum of |q_d k_d|: near-ties are wider
# (measured on the H200: at most 8.1e-4 of the row scale at S=2500, 3.9e-4 at S=700).
FP8_SCORE_TOL = 2.0 ** -9
# the register epilogue's own rounding, relative to sum_h |w_h| relu(q_h . k) * ks: "lanes" sums in fp32; "mma"
# rounds each ReLU'd product and each weight to bf16 (2^-9 relative each) before its fp32 tensor-core sum
# ("mma_pairs": the same roundings, its fp32 sums in another order)
EPILOGUE_TOL = {"lanes": 2.0 ** -18, "mma": 2.0 ** -7, "mma_pairs": 2.0 ** -7}


def _exact_topk(scores, starts, ends, topk):
    """The exact top-k ids of each row's [start, end): by score desc, then id asc; -1 padded."""
    keys = torch.arange(scores.shape[1], device=scores.device)
    valid = (keys >= starts[:, None].long()) & (keys < ends[:, None].long())
    idx = torch.sort(scores.masked_fill(~valid, float("-inf")), dim=1, descending=True, stable=True).indices
    idx = idx.gather(1, torch.sort((~valid).gather(1, idx).int(), dim=1, stable=True).indices)[:, :topk]
    n = valid.sum(1, keepdim=True)
    return torch.where(torch.arange(idx.shape[1], device=idx.device)[None] < n, idx, -1).int()


def _inputs(S, H, D, packed=False, seed=0, Sk=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Sk = Sk or S
    q = torch.randn(S, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(Sk, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(S, H, device="cuda", generator=g) * H ** -0.5
    pos = torch.arange(S, device="cuda", dtype=torch.int32)
    if packed:  # three documents: keys from the document start up to the query
        bounds = torch.tensor([0, S // 3, S // 2], device="cuda", dtype=torch.int32)
        starts = bounds[(pos[:, None] >= bounds[None]).sum(1) - 1]
    else:
        starts = torch.zeros_like(pos)
    ends = pos + 1
    return q, k, w, starts, ends


def _check_rows(ids, scores, topk, starts, ends, tol_rel=SCORE_TOL):
    """Kernel-independent checks: valid, unique, sorted, and a correct top-k set up to ties.
    Returns the number of rows whose set differs from the exact sorted reference set."""
    S = ids.shape[0]
    n_valid = (ends - starts).clamp(min=0).long()
    want = n_valid.clamp(max=topk)
    got_n = (ids >= 0).sum(1)
    assert torch.equal(got_n, want), "wrong number of valid IDs per row"
    pos = torch.arange(topk, device=ids.device)
    assert bool(((ids >= 0) == (pos[None] < want[:, None])).all()), "-1 padding not at the end"
    safe = ids.long().clamp(min=0)
    in_range = (safe >= starts[:, None]) & (safe < ends[:, None])
    assert bool(in_range[ids >= 0].all()), "ID outside [start, end)"
    srt = torch.sort(torch.where(ids >= 0, ids.long(), -1 - pos[None]), dim=1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "duplicate IDs in a row"
    sel = torch.gather(scores, 1, safe).masked_fill(ids < 0, float("-inf"))
    scale = scores.masked_fill(torch.isinf(scores), 0).abs().amax(1, keepdim=True).clamp_min(1e-6)
    tol = tol_rel * scale
    assert bool((sel[:, 1:] <= sel[:, :-1] + tol).all()), "IDs not sorted by descending score"
    # the smallest selected score is >= every unselected valid score (up to tol)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, safe, ids >= 0)
    rest = scores.masked_fill(chosen, float("-inf")).amax(1)
    kth = sel.masked_fill(ids < 0, float("inf")).amin(1)
    full = want == topk
    assert bool((rest[full] <= kth[full] + tol[full, 0]).all()), "a better key was left out"
    exact = torch.topk(scores, topk, dim=1).indices if scores.shape[1] >= topk else None
    if exact is None:
        return 0
    a = torch.sort(torch.where(ids >= 0, ids.long(), -1), 1).values
    b = torch.sort(torch.where(torch.isinf(torch.gather(scores, 1, exact)), -1, exact), 1).values
    return int((a != b).any(1).sum())


@pytest.mark.parametrize("S,H,D,topk,packed", [
    (700, 32, 128, 64, False),     # GLM-5.2 indexer shape, short rows and radix rows
    (2500, 32, 128, 2048, True),   # real top-k, packed documents
    (1000, 8, 64, 256, False),     # other head count / dim (block_Q = 16)
])
def test_topk_matches_reference_up_to_ties(S, H, D, topk, packed):
    q, k, w, starts, ends = _inputs(S, H, D, packed)
    scale = D ** -0.5
    ids = torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, topk, scale)
    assert ids.dtype == torch.int32 and ids.shape == (S, topk) and ids.is_contiguous()
    scores = ref_dsa_scores(q, k, w, starts, ends, scale)
    _check_rows(ids, scores, topk, starts, ends)
    ref = _dsa_topk_kernel(q, k, w, starts, ends, topk, scale)  # the PyTorch kernel, on CUDA
    same_set = (torch.sort(ids, 1).values == torch.sort(ref, 1).values).all(1)
    assert float(same_set.float().mean()) >= 0.99, f"only {float(same_set.float().mean()):.4f} rows equal"


@pytest.mark.parametrize("H", [2, 4, 48])
def test_head_counts_the_kernel_does_not_take_run_the_reference(H):
    """Head counts outside ``KERNEL_HEADS`` (the tiny model's 2 indexer heads, 48) run the PyTorch kernel, warn
    once, and give exactly its ids: with 2 heads the logits kernel's 64-query blocks selected wrong keys."""
    q, k, w, starts, ends = _inputs(700, H, 128)
    _common._warned.discard(f"glm52::dsa_topk_indices:heads{H}")
    with pytest.warns(UserWarning, match=f"{H} heads run the PyTorch reference kernel"):
        ids = torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, 64, 128 ** -0.5)
    assert torch.equal(ids, _dsa_topk_kernel(q, k, w, starts, ends, 64, 128 ** -0.5))


def test_topk_tie_differences_are_quantified():
    """Force exact ties (integer-valued scores with many repeats) and count how the kernel's picks at
    the boundary differ from the reference's; every difference must be a tie."""
    S, H, D, topk = 1200, 32, 128, 256
    q, k, w, starts, ends = _inputs(S, H, D, seed=3)
    k = (k.float() * 2).round().clamp(-2, 2).bfloat16()  # few distinct key vectors -> tied scores
    q = (q.float() * 2).round().clamp(-2, 2).bfloat16()
    w = torch.ones_like(w)
    ids = torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, topk, 1.0)
    scores = ref_dsa_scores(q, k, w, starts, ends, 1.0)
    ref = _dsa_topk_kernel(q, k, w, starts, ends, topk, 1.0)
    differing = _check_rows(ids, scores, topk, starts, ends)
    a, b = ids.long().clamp(min=0), ref.long().clamp(min=0)
    ga = torch.gather(scores, 1, a).masked_fill(ids < 0, 0).sort(1).values
    gb = torch.gather(scores, 1, b).masked_fill(ref < 0, 0).sort(1).values
    # same multiset of selected scores in every row: the differences are only among equal scores
    assert torch.equal(ga, gb), "the kernel and the reference select different score multisets"
    rows_diff = int((torch.sort(ids, 1).values != torch.sort(ref, 1).values).any(1).sum())
    print(f"tie rows differing from torch.topk: {rows_diff}/{S}; from exact sort: {differing}/{S}")


def test_topk_all_keys_valid_and_empty_rows():
    S, H, D, topk = 300, 32, 128, 128
    q, k, w, _, _ = _inputs(S, H, D, seed=5, Sk=500)
    starts = torch.zeros(S, dtype=torch.int32, device="cuda")
    ends = torch.full((S,), 500, dtype=torch.int32, device="cuda")
    ends[:5] = 0  # empty rows -> all -1
    ids = torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, topk, 0.1)
    assert bool((ids[:5] == -1).all())
    scores = ref_dsa_scores(q, k, w, starts, ends, 0.1)
    _check_rows(ids, scores, topk, starts, ends)


def _chunked_op(q, k, w, starts, ends, topk, scale, ks=None, *, buffers, rows_per_chunk, priority=0):
    """The op with ``rows_per_chunk`` queries a logits buffer and ``buffers`` buffers (TopkConfig)."""
    Sp = -(-k.shape[0] // tl_ops.BLOCK_N) * tl_ops.BLOCK_N
    config = TopkConfig(logits_budget_bytes=rows_per_chunk * Sp * 4, buffers=buffers, select_priority=priority)
    return tl_ops.dsa_topk_indices_tl(q, k, w, starts, ends, topk, scale, ks, config=config)


@pytest.mark.parametrize("fp8", [False, True])
def test_overlapped_chunks_give_the_one_chunk_ids(fp8):
    """Chunks whose select runs on the side stream while the next chunk's logits fill the other buffer (and the
    last chunk padded, its padded starts/ends alive on the side stream) give the ids of one chunk on one
    stream, element for element, with either stream priority; so does one buffer with many chunks. The
    caller's stream is free to reuse the op's memory straight after: a fill queued there does not reach `out`."""
    from glm52_model.ops.dsa_topk import quantize_indexer
    S, H, D, topk = 2502, 32, 128, 2048
    q, k, w, starts, ends = _inputs(S, H, D, packed=True, seed=11)
    ks = None
    if fp8:
        q, k, w, ks = quantize_indexer(q, k, w)
    scale = D ** -0.5
    one = _chunked_op(q, k, w, starts, ends, topk, scale, ks, buffers=1, rows_per_chunk=4096)
    if not fp8:                                   # (the FP8 kernels' own accuracy: the FP8 tests above)
        _check_rows(one, ref_dsa_scores(q, k, w, starts, ends, scale), topk, starts, ends)
    for buffers, priority in [(1, 0), (2, 0), (2, -1), (3, 0)]:
        got = _chunked_op(q, k, w, starts, ends, topk, scale, ks, buffers=buffers, rows_per_chunk=388,
                          priority=priority)                      # 7 chunks, the last of 174 rows padded to 176
        junk = torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xff)  # reuses freed op memory
        assert torch.equal(got, one), f"buffers={buffers}, priority={priority}: ids differ from one chunk's"
        del junk


def test_overlapped_chunks_capture_in_a_cuda_graph():
    """The side stream forks from and joins the caller's stream, so the op records into a CUDA graph; the
    replay on new inputs gives the eager ids."""
    S, H, D, topk = 1500, 32, 128, 512
    q, k, w, starts, ends = _inputs(S, H, D, packed=True, seed=13)
    q2, k2, w2, _, _ = _inputs(S, H, D, packed=True, seed=14)
    run = lambda: _chunked_op(q, k, w, starts, ends, topk, 0.1, buffers=2, rows_per_chunk=400)  # noqa: E731
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):                                  # warm-up off the default stream
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for src, dst in ((q2, q), (k2, k), (w2, w)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = _chunked_op(q, k, w, starts, ends, topk, 0.1, buffers=1, rows_per_chunk=4096)
    assert torch.equal(out, want)


@pytest.mark.parametrize("S,topk,packed", [(700, 64, False), (2500, 2048, True)])
def test_fp8_logits_kernel_matches_the_fp8_reference_up_to_ties(S, topk, packed):
    """The e4m3 logits kernel (same op, ``quantize_indexer`` inputs) against its own math (the dequantised
    scores): a correct top-k up to ties; against the bf16 kernel: overlapping sets (reported, >= 0.9)."""
    _fp8_logits_kernel_matches_the_fp8_reference(S, topk, packed)


def _fp8_logits_kernel_matches_the_fp8_reference(S, topk, packed):
    from glm52_model.ops.dsa_topk import id_overlap, quantize_indexer
    q, k, w, starts, ends = _inputs(S, 32, 128, packed)
    scale = 128 ** -0.5
    q8, k8, w8, ks = quantize_indexer(q, k, w)
    ids = torch.ops.glm52.dsa_topk_indices(q8, k8, w8, starts, ends, topk, scale, k_scale=ks)
    assert ids.dtype == torch.int32 and ids.shape == (S, topk)
    scores = ref_dsa_scores(q8.float(), k8.float() * ks[:, None], w8, starts, ends, scale)
    # the logits kernel itself: within FP8_SCORE_TOL of the fp32 math on the same e4m3 inputs
    arch = tl_ops.cuda_target()["arch"]
    lk = tl_ops.logits_kernel(32, 128, torch.float8_e4m3fn, arch)                # the op's tiles
    Sp = -(-S // tl_ops.BLOCK_N) * tl_ops.BLOCK_N
    pad = lambda t, n: torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])        # noqa: E731
    logits = torch.full((S, Sp), float("-inf"), device="cuda")                  # tiles never computed stay -inf
    lk(q8.view(S * 32, 128), pad(k8.view(torch.uint8), Sp).view(k8.dtype), pad(ks.float(), Sp),
       (w8.float() * scale).contiguous(), starts, ends, logits)
    row_scale = scores.masked_fill(torch.isinf(scores), 0).abs().amax(1, keepdim=True).clamp_min(1e-6)
    fin = torch.isfinite(scores)
    assert torch.equal(torch.isfinite(logits[:, :S]), fin), "masking differs"
    # the tensor cores' FP8 accumulation, plus the epilogue's own rounding ("mma": bf16 head products, bounded
    # by the sum of their magnitudes, which the weights' mixed signs make far larger than the score itself)
    epilogue = tl_ops.logits_epilogue(32, 4, True)
    bound = ref_dsa_scores(q8.float(), k8.float() * ks[:, None], w8.abs(), starts, ends, scale)
    allowed = FP8_SCORE_TOL * row_scale + EPILOGUE_TOL.get(epilogue, 0.0) * bound.masked_fill(~fin, 0)
    err = (logits[:, :S] - scores).abs()
    print(f"FP8 logits vs fp32 math on the e4m3 inputs ({epilogue} epilogue): max error "
          f"{float((err / row_scale)[fin].max()):.2e} of the row scale, "
          f"{float((err / allowed)[fin].max()):.2f} of the allowed")
    assert bool((err[fin] <= allowed[fin]).all())
    _check_rows(ids, scores, topk, starts, ends, float((allowed / row_scale)[fin].max()))
    ref = _dsa_topk_kernel(q8, k8, w8, starts, ends, topk, scale, ks)        # PyTorch kernel, FP8 inputs
    bf16_ids = torch.ops.glm52.dsa_topk_indices(q, k, w, starts, ends, topk, scale)
    overlap = id_overlap(ids, bf16_ids)
    ref_overlap = float(id_overlap(ref, bf16_ids).mean())
    print(f"FP8 vs bf16 ID-set overlap at S={S}: mean {float(overlap.mean()):.4f}, min {float(overlap.min()):.4f} "
          f"(the PyTorch FP8 kernel's: {ref_overlap:.4f}); vs the PyTorch FP8 kernel "
          f"{float(id_overlap(ids, ref).mean()):.4f}")
    assert float(overlap.mean()) >= 0.9
    # the epilogue's rounding costs the selection nothing measurable: the fp32 reference's overlap with the bf16 op
    assert float(overlap.mean()) >= ref_overlap - 0.005


@pytest.mark.parametrize("over", [{}, {"sort_elems": 16, "threads": 256, "vec": 8}, {"sort_elems": 16, "threads": 256},
                                  {"vec": 1, "min_blocks": 1}, {"candidates": 4096, "sample_group": 1}],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()) or "op")
def test_select_is_a_correct_topk_on_packed_rows(over):
    """The op's select (``over``: its numeric tunables changed) is a correct top-k up to ties on the same logits,
    rows starting and ending off a vector's edge (vec), the 12-bit round's rows; on rows without ties, the exact
    top-k in order."""
    config = dataclasses.replace(SelectConfig(), **over)
    S, H, D, topk = 3000, 32, 128, 2048
    q, k, w, _, ends = _inputs(S, H, D, seed=7)
    bounds = torch.tensor([0, 1001, 1503], device="cuda", dtype=torch.int32)   # documents off a vector edge
    starts = bounds[(torch.arange(S, device="cuda")[:, None] >= bounds[None]).sum(1) - 1]
    scores = ref_dsa_scores(q, k, w, starts, ends, D ** -0.5)                  # -inf outside the range
    Sp = -(-S // tl_ops.BLOCK_N) * tl_ops.BLOCK_N                              # rows padded as the op pads them
    scores = torch.nn.functional.pad(scores, (0, Sp - S), value=float("-inf"))
    assert bool((starts % 4 != 0).any()) and bool((ends % 4 != 0).any()), "no row starts off a vector edge"
    arch = tl_ops.cuda_target()["arch"]
    got = torch.empty(S, topk, dtype=torch.int32, device="cuda")
    topk_select_tl.compile_topk_select(topk, arch, config)(scores, starts, ends, got)
    _check_rows(got, scores, topk, starts, ends)
    want = _exact_topk(scores, starts, ends, topk)
    same = (torch.sort(got, 1).values == torch.sort(want, 1).values).all(1)
    assert float(same.float().mean()) >= 0.99


def test_select_falls_back_to_the_row_when_the_bin_overflows():
    """Rows shorter than the sampled round's whose 12-bit threshold bin holds more keys than the candidates' buffer
    (all tied, or few distinct values) run the radix rounds on the row: still the exact top-k."""
    topk, Sk = 2048, 8192                                   # < SAMPLE_MIN_ROW * candidates: the 12-bit round
    g = torch.Generator(device="cuda").manual_seed(17)
    n = 8
    scores = torch.cat([torch.full((n, Sk), 0.75, device="cuda"),
                        torch.randint(0, 3, (n, Sk), device="cuda", generator=g).float(),
                        1.0 + 1e-3 * torch.rand(n, Sk, device="cuda", generator=g)])   # one 12-bit bin
    R = scores.shape[0]
    starts = torch.randint(0, 9, (R,), device="cuda", generator=g, dtype=torch.int32)
    ends = Sk - torch.randint(0, 9, (R,), device="cuda", generator=g, dtype=torch.int32)
    assert Sk < topk_select_tl.SAMPLE_MIN_ROW * SelectConfig().candidates
    got = torch.empty(R, topk, dtype=torch.int32, device="cuda")
    tl_ops.select_kernel(topk, tl_ops.cuda_target()["arch"])(scores, starts, ends, got)
    keys = torch.arange(Sk, device="cuda")
    valid = (keys >= starts[:, None].long()) & (keys < ends[:, None].long())
    scores = scores.masked_fill(~valid, float("-inf"))
    _check_rows(got, scores, topk, starts, ends, tol_rel=0.0)
    distinct = slice(2 * n, 3 * n)                          # distinct scores: the exact ids in order
    assert torch.equal(got[distinct], _exact_topk(scores, starts, ends, topk)[distinct])


def _logits_inputs(S, H, dtype, seed=5):
    """Packed-document inputs of the logits kernel alone: (q rows, padded k, padded key scales, weights with
    the op's scale folded in, starts, ends, padded key count)."""
    from glm52_model.ops.dsa_topk import quantize_indexer
    q, k, w, starts, ends = _inputs(S, H, 128, packed=True, seed=seed)
    scale = 128 ** -0.5
    if dtype == torch.bfloat16:
        qq, kk, ks, ww = q, k, torch.ones(S, device="cuda"), (w * scale).contiguous()
    else:
        qq, kk, w8, ks = quantize_indexer(q, k, w)
        ks, ww = ks.float(), (w8.float() * scale).contiguous()
    Sp = -(-S // tl_ops.BLOCK_N) * tl_ops.BLOCK_N
    pad = lambda t, n: torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])        # noqa: E731
    kp, ksp = pad(kk.view(torch.uint8), Sp).view(kk.dtype), pad(ks, Sp)
    return qq.view(S * H, 128), kp, ksp, ww, starts, ends, Sp


def _run_logits(H, dtype, config, inputs):
    qq, kp, ksp, ww, starts, ends, Sp = inputs
    S = starts.shape[0]
    logits = torch.full((S, Sp), float("nan"), device="cuda")
    arch = tl_ops.cuda_target()["arch"]
    tl_ops.compile_indexer_logits(H, 128, arch, dtype, config)(qq, kp, ksp, ww, starts, ends, logits)
    return logits


@pytest.mark.parametrize("over", [{"min_blocks": 1}, {"min_blocks": 5}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_logits_kernel_register_bound_writes_the_same_logits(dtype, over):
    """The op's logits kernel with another register bound (``over``) writes the same logits, bit for bit, on
    packed documents whose tiles straddle the ranges: the bound changes no arithmetic."""
    inputs = _logits_inputs(2500, 32, dtype)
    out = [_run_logits(32, dtype, c, inputs) for c in (LogitsConfig(), dataclasses.replace(LogitsConfig(), **over))]
    assert torch.equal(torch.isnan(out[0]), torch.isnan(out[1])), "the two builds cover different tiles"
    written = ~torch.isnan(out[0])
    assert bool(written[:, :2500].any())
    torch.testing.assert_close(out[1][written], out[0][written], rtol=0, atol=0)


@pytest.mark.parametrize("H", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_logits_kernel_matches_the_fp32_math(dtype, H):
    """Each register epilogue the op dispatches to ("lanes": bf16; "mma": FP8 at 16 and 64 heads;
    "mma_pairs": FP8 at 32) gives the fp32 math's logits on the same inputs within the tensor cores' accumulation
    and its own rounding, with -inf outside each query's key range, for 2 to 8 queries a block. A wrong
    register-to-(key, query, head) map would be off by a head's whole weighted product, far above the bound."""
    S = 2500
    inputs = _logits_inputs(S, H, dtype, seed=7)
    qq, kp, ksp, ww, starts, ends, Sp = inputs
    got = _run_logits(H, dtype, LogitsConfig(), inputs)
    keys = torch.arange(Sp, device="cuda")
    valid = (keys >= starts[:, None]) & (keys < ends[:, None])
    written = ~torch.isnan(got)
    assert bool(written[valid].all()), "a key inside the range is not written"
    assert bool(torch.isneginf(got[written & ~valid]).all()), "a key outside the range is not -inf"
    want = ref_dsa_scores(qq.view(S, H, 128).float(), kp.float(), ww, starts, ends, 1.0) * ksp
    bound = ref_dsa_scores(qq.view(S, H, 128).float(), kp.float(), ww.abs(), starts, ends, 1.0) * ksp
    epilogue = tl_ops.logits_epilogue(H, 128 // H, dtype != torch.bfloat16)
    row_scale = want.masked_fill(~valid, 0).abs().amax(1, keepdim=True).clamp_min(1e-6)
    gemm_tol = FP8_SCORE_TOL if dtype != torch.bfloat16 else SCORE_TOL
    allowed = (gemm_tol * row_scale + EPILOGUE_TOL[epilogue] * bound)[valid]
    err = (got - want).abs()[valid]
    assert bool((err <= allowed + 1e-30).all()), f"{epilogue}: max err / allowed {float((err / allowed).max())}"


SAMPLED_SELECTS = [                                        # overrides of the op's SelectConfig ({}: the op's)
    {},
    {"sample": 16, "threads": 256, "min_blocks": 1},
    {"unroll": 1},                                                        # one vector a thread in flight
    {"unroll": 4},
]


def _long_rows(Sk, rows_per_kind, seed=3):
    """Rows of >= 16K keys of the kinds that defeat a sampled bound, beside ordinary ones: Gaussian, rising with
    position (the top-k all at the end), constant (every key ties), four distinct values, 95% -inf, and high
    scores only every 32nd key (the sample's period: it sees all of them or none), with starts and ends off a
    vector's edge; and a few short rows (the 12-bit round)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = rows_per_kind
    pos = torch.arange(Sk, device="cuda", dtype=torch.float32)
    kinds = [torch.randn(n, Sk, device="cuda", generator=g),
             pos.expand(n, Sk) + 0.1 * torch.rand(n, Sk, device="cuda", generator=g),
             torch.full((n, Sk), 1.5, device="cuda"),
             torch.randint(0, 4, (n, Sk), device="cuda", generator=g).float(),
             torch.randn(n, Sk, device="cuda", generator=g).masked_fill(
                 torch.rand(n, Sk, device="cuda", generator=g) < 0.95, float("-inf")),
             torch.randn(n, Sk, device="cuda", generator=g) + 10.0 * (pos % 32 == 0).float()]
    scores = torch.cat(kinds)
    R = scores.shape[0]
    starts = torch.randint(0, 9, (R,), device="cuda", generator=g, dtype=torch.int32)
    ends = Sk - torch.randint(0, 9, (R,), device="cuda", generator=g, dtype=torch.int32)
    ends[::7] = starts[::7] + 3000                                            # short rows
    keys = torch.arange(Sk, device="cuda")
    valid = (keys >= starts[:, None].long()) & (keys < ends[:, None].long())
    return scores.masked_fill(~valid, float("-inf")).contiguous(), starts, ends


@pytest.mark.parametrize("over", SAMPLED_SELECTS,
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()) or "op")
def test_sampled_select_is_exact_on_long_rows(over):
    """The sampled first round (a bound from every sample-th vector, then one pass keeping the keys above it) is
    a correct top-k up to ties on rows long enough to take it, including rows built to make the bound miss
    (they fall back to the rounds on the row), and the exact top-k in order on rows without ties."""
    Sk, topk = 20480, 2048                                 # >= SAMPLE_MIN_ROW * candidates keys: the sampled round
    config = dataclasses.replace(SelectConfig(), **over)
    assert config.sample and Sk - 16 >= topk_select_tl.SAMPLE_MIN_ROW * config.candidates
    scores, starts, ends = _long_rows(Sk, 24)
    arch = tl_ops.cuda_target()["arch"]
    got = torch.empty(scores.shape[0], topk, dtype=torch.int32, device="cuda")
    topk_select_tl.compile_topk_select(topk, arch, config)(scores, starts, ends, got)
    _check_rows(got, scores, topk, starts, ends, tol_rel=0.0)
    exact = _exact_topk(scores, starts, ends, topk)
    gaussian = slice(0, 24)                                # distinct scores: one right answer, the same ids in order
    assert torch.equal(got[gaussian], exact[gaussian])
    rising = slice(24, 48)
    assert torch.equal(got[rising], exact[rising])


def test_select_orders_by_score_then_id():
    """The select's order (the counting sort, or the bitonic sort where a bucket is skewed) is the exact one: the
    same scores in the same places as the exact top-k, and element for element the same ids (score desc, then id
    asc) where no tie is cut at the k-th score: on long rows (the sampled round) and short ones, Gaussian,
    spanning zero, with pairs of equal scores, with one outlier (the bitonic sort), all tied, half -inf and
    shorter than top-k."""
    topk, Sk = 2048, 20480
    g = torch.Generator(device="cuda").manual_seed(11)
    n = 8
    pos = torch.arange(Sk, device="cuda")
    kinds = [torch.randn(n, Sk, device="cuda", generator=g),
             torch.randn(n, Sk, device="cuda", generator=g) * 0.01 - 0.005,          # around zero, both signs
             (torch.randn(n, Sk // 2, device="cuda", generator=g)).repeat_interleave(2, 1),  # pairs of ties
             torch.randn(n, Sk, device="cuda", generator=g).index_fill(1, pos[:1] + 77, 1e30),  # an outlier
             torch.full((n, Sk), 0.25, device="cuda"),
             torch.randn(n, Sk, device="cuda", generator=g).masked_fill(pos % 2 == 0, float("-inf"))]
    scores = torch.cat(kinds)
    R = scores.shape[0]
    starts = torch.randint(0, 9, (R,), device="cuda", generator=g, dtype=torch.int32)
    ends = Sk - torch.randint(0, 9, (R,), device="cuda", generator=g, dtype=torch.int32)
    ends[1::4] = starts[1::4] + 3000                         # the 12-bit round's rows
    ends[2::8] = starts[2::8] + 1500                         # fewer keys than top-k: -1 padded
    valid = (pos >= starts[:, None].long()) & (pos < ends[:, None].long())
    scores = scores.masked_fill(~valid, float("-inf")).contiguous()
    got = torch.empty(R, topk, dtype=torch.int32, device="cuda")
    tl_ops.select_kernel(topk, tl_ops.cuda_target()["arch"])(scores, starts, ends, got)
    want = _exact_topk(scores, starts, ends, topk)
    _check_rows(got, scores, topk, starts, ends, tol_rel=0.0)
    at = lambda ids: torch.gather(scores, 1, ids.long().clamp(min=0)).masked_fill(ids < 0, float("nan"))  # noqa: E731
    assert torch.equal(at(got).nan_to_num(7.0), at(want).nan_to_num(7.0))
    srt = torch.sort(scores.masked_fill(~valid, float("nan")).nan_to_num(float("-inf")), 1, descending=True).values
    n_valid = valid.sum(1)
    uncut = (n_valid <= topk) | (srt[:, topk - 1] > srt[:, topk])
    assert int(uncut.sum()) >= R // 2
    assert torch.equal(got[uncut], want[uncut])
