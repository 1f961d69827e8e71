"""glm52::fp8_grouped_mm (FP8 routed experts): opcheck, the fake-quant reference, FP8 vs fp32 within the
dense FP8 linears' stated error (cosine >= 0.998, relative L2 <= 6%: tests/ops/test_fp8.py), uneven and empty
groups, no tile across two experts, and the tiny model trained 20 steps with FP8 experts against bf16-style
experts (loss within 1%)."""
import pytest
import torch
from tests.support.helpers import assert_similar

import glm52_model.ops
from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.ops.fp8 import quantize_1x128
from glm52_model.ops.fp8_grouped_mm import ref_fp8_grouped_mm
from glm52_model.ops.grouped_mm import ref_grouped_mm

OP, BWD = torch.ops.glm52.fp8_grouped_mm, torch.ops.glm52.fp8_grouped_mm_bwd
FP8_MIN_COS, FP8_MAX_REL = 0.998, 0.06


def _inputs(R=300, K=200, N=136, offs=(70, 70, 250, 290)):
    """K and N not multiples of 128, an empty expert, rows past offs[-1], groups not 128-aligned."""
    torch.manual_seed(0)
    x = torch.randn(R, K, requires_grad=True)
    w = (torch.randn(len(offs), K, N) * K ** -0.5).requires_grad_()
    return x, w, torch.tensor(offs, dtype=torch.int32)


def test_forward_is_the_fake_quant_reference():
    x, w, offs = _inputs()
    y = OP(x, w, offs)
    assert y.shape == (300, 136) and y.dtype == x.dtype
    torch.testing.assert_close(y, ref_fp8_grouped_mm(x.detach(), w.detach(), offs), rtol=1e-5, atol=1e-5)
    assert bool((y[290:] == 0).all())                                            # no expert: 0


def test_fp8_vs_fp32_forward_and_both_grads():
    x, w, offs = _inputs()
    dy = torch.randn(300, 136)
    OP(x, w, offs).backward(dy)
    x32, w32 = x.detach().requires_grad_(), w.detach().requires_grad_()
    y32 = ref_grouped_mm(x32, w32, offs)
    y32.backward(dy)
    assert_similar(OP(x, w, offs), y32, min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what="y")
    assert_similar(x.grad, x32.grad, min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what="dx")
    assert_similar(w.grad, w32.grad, min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what="dw")
    assert bool((w.grad[1] == 0).all()) and bool((x.grad[290:] == 0).all())


def test_wgrad_tiles_never_straddle_two_experts():
    """Expert 0's rows are tiny, expert 1's huge: a 1x128 tile along tokens shared by both would scale
    expert 0's gradient by expert 1's amax and flush it to zero in e4m3. Per-expert slots keep it exact-ish."""
    torch.manual_seed(1)
    K, N = 128, 128
    x = torch.cat([torch.randn(60, K) * 1e-3, torch.randn(68, K) * 1e3])
    w = torch.randn(2, K, N)
    dy = torch.randn(128, N)
    offs = torch.tensor([60, 128], dtype=torch.int32)
    _, dw = BWD(dy, x, w, offs)
    ref0 = x[:60].T @ dy[:60]
    assert_similar(dw[0], ref0, min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what="dw of the small expert")


@pytest.mark.parametrize("offs", [(0, 0, 0), (5, 5, 5), (1, 2, 3)])
def test_degenerate_groups(offs):
    x, w, o = _inputs(R=5, K=32, N=16, offs=offs)
    y = OP(x, w, o)
    y.sum().backward()
    assert torch.equal(y[o[-1]:], torch.zeros_like(y[o[-1]:]))
    torch.testing.assert_close(y, ref_fp8_grouped_mm(x.detach(), w.detach(), o), rtol=1e-5, atol=1e-5)


def test_opcheck():
    x, w, offs = _inputs(R=40, K=32, N=24, offs=(7, 7, 30, 40))
    torch.library.opcheck(OP, (x, w, offs))
    torch.library.opcheck(BWD, (torch.randn(40, 24), x.detach(), w.detach(), offs))


def test_bad_inputs_name_the_op():
    x, w, offs = _inputs(R=8, K=32, N=16, offs=(4, 8, 8, 8))
    with pytest.raises(RuntimeError, match="grouped_mm: offs must be int32"):
        OP(x, w, offs.long())
    with pytest.raises(RuntimeError, match=r"grouped_mm: x \[R, K\] and w \[E, K, N\]"):
        OP(x, w.transpose(1, 2), offs)


@pytest.mark.parametrize("gemm_rows", [128, 4, 1])
def test_forward_rows_in_place_and_tails_exact(gemm_rows):
    """The forward's per-expert GEMMs on rows in place (a body of gemm_rows multiples, a padded tail GEMM):
    uneven groups with an empty expert, 1-row experts, a tail at the last expert and rows of no expert, N not a
    multiple of 128. Integer data with one +-448 per tile and block (scale 1, exact fp32 sums) makes the
    fake-quant reference exact whatever the GEMM shapes, so any misplaced row or wrong tail row shows."""
    from glm52_model.ops import fp8_grouped_mm as fgm
    g = torch.Generator().manual_seed(3)
    R, K, N = 400, 256, 200
    offs = torch.tensor([0, 1, 131, 131, 260, 261, 390], dtype=torch.int32)
    x = torch.randint(-8, 9, (R, K), generator=g).float()
    x[:, ::128] = 448 * (torch.randint(0, 2, (R, K // 128), generator=g) * 2 - 1)
    w = torch.randint(-8, 9, (len(offs), K, N), generator=g).float()
    w[:, ::128, ::128] = 448.0
    y = fgm.fp8_grouped_mm_kernel(x, w, offs, gemm_rows=gemm_rows)
    ref = ref_fp8_grouped_mm(x, w, offs)
    assert y.shape == (R, N) and torch.equal(y, ref)
    assert torch.equal(y[0], x[0] @ w[1]) and torch.equal(y[260], x[260] @ w[5])   # the 1-row experts
    assert bool((y[390:] == 0).all())


def test_quantisation_is_per_row_so_grouping_cannot_change_the_forward():
    """1x128 tiles along K are per row: quantising all rows at once equals quantising each group."""
    x = torch.randn(10, 256)
    q_all, s_all = quantize_1x128(x)
    q_part, s_part = quantize_1x128(x[3:7])
    assert torch.equal(q_all[3:7].view(torch.uint8), q_part.view(torch.uint8)) and torch.equal(s_all[3:7], s_part)


def _batch(g: torch.Generator, vocab: int) -> torch.Tensor:
    """Learnable but not memorisable: x[t+1] = (5 x[t] + 3) mod V from a fresh random start per sequence."""
    x = [torch.randint(0, vocab, (8,), generator=g)]
    for _ in range(63):
        x.append((5 * x[-1] + 3) % vocab)
    return torch.stack(x, 1)


def _train(fp8_experts: bool, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    cfg = GLM52Config.tiny(fp8=True, fp8_experts=fp8_experts, recompute=False, mtp_layers=0)
    model = GLM52ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = _batch(g, cfg.vocab_size)
        loss = model(ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_tiny_model_20_steps_fp8_experts_loss_within_1_percent():
    """The FP8 experts' numerics target on the CPU: the tiny model (FP8 linears) trained 20 steps with FP8 routed
    experts ends within 1% of the same run with unquantised experts, and both actually train."""
    fp8 = _train(True)
    ref = _train(False)
    assert fp8[-1] < fp8[0] * 0.8, f"did not train: {fp8[0]:.4f} -> {fp8[-1]:.4f}"
    assert abs(fp8[-1] - ref[-1]) <= 0.01 * ref[-1], f"loss after 20 steps {fp8[-1]:.4f} vs {ref[-1]:.4f}"
    assert fp8 != ref                                                            # the FP8 path really ran


def test_model_uses_the_fp8_op_only_when_asked():
    from sacpass.testing import OpCounter
    for flag, op in ((True, "glm52::fp8_grouped_mm"), (False, "glm52::grouped_mm")):
        torch.manual_seed(0)
        cfg = GLM52Config.tiny(fp8_experts=flag, mtp_layers=0)
        model = GLM52ForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, 32))
        names = [f"glm52::{p}grouped_mm{s}" for p in ("", "fp8_") for s in ("", "_pair", "_combine")]
        with OpCounter(*names) as calls:
            model(ids, labels=ids)
        assert calls.count("forward", op + "_pair.") == 2, calls.counts          # gate and up, 2 MoE layers
        assert calls.count("forward", op + "_combine.") == 2, calls.counts       # down and the sum
        assert calls.forward == 4                                                 # nothing else
        other = "glm52::grouped_mm" if flag else "glm52::fp8_grouped_mm"
        assert calls.count(op=other) == 0


@pytest.mark.slow
def test_compiled_with_sacpass_matches_eager_and_keeps_the_topk():
    """Two tiny layers (dense, MoE) with FP8 linears and FP8 experts, compile(checkpoint(layer)) with
    sacpass: the graph holds the FP8 grouped op, the backward re-runs no top-k, grads equal eager."""
    import copy

    import sacpass
    from glm52_model.compile import apply_compile
    from sacpass.testing import OpCounter

    torch.manual_seed(0)
    cfg = GLM52Config.tiny(fp8=True, fp8_experts=True, num_layers=2, mtp_layers=0)
    eager = GLM52ForCausalLM(cfg)
    compiled = copy.deepcopy(eager)
    be = sacpass.backend(inner="aot_eager")
    apply_compile(compiled, backend=be)
    ids = _batch(torch.Generator().manual_seed(2), cfg.vocab_size)[:2]
    eager(ids, labels=ids).backward()
    with OpCounter("glm52::dsa_topk_indices", "aten::topk", "glm52::fp8_grouped_mm_pair",
                   "glm52::fp8_grouped_mm_pair_bwd", "glm52::fp8_grouped_mm_combine",
                   "glm52::fp8_grouped_mm_combine_bwd") as calls:
        compiled(ids, labels=ids).backward()
    assert calls.count("backward", "glm52::dsa_topk_indices") == 0 and calls.count("backward", "aten::topk") == 0
    assert calls.count("backward", "glm52::fp8_grouped_mm_pair_bwd") == 1            # the experts' backward ran
    assert calls.count("backward", "glm52::fp8_grouped_mm_combine_bwd") == 1
    assert calls.count("forward", "glm52::fp8_grouped_mm_pair.") == 1                 # in the compiled graph
    assert calls.count("forward", "glm52::fp8_grouped_mm_combine.") == 1
    assert any("fp8_grouped_mm" in op for r in be.reports for op in r.recomputed), [dict(r.recomputed) for r in be.reports]
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_flop_formulas_count_the_experts_gemms():
    from torch.utils.flop_counter import FlopCounterMode
    x, w, offs = _inputs(R=40, K=32, N=24, offs=(7, 7, 30, 40))
    with FlopCounterMode(display=False) as fc:
        OP(x, w, offs).sum().backward()
    assert fc.get_total_flops() == 2 * 40 * 32 * 24 + 4 * 40 * 32 * 24


def test_gathered_rows_are_the_gathered_copy_bit_for_bit():
    """With ``rows`` (each token's row once per expert it picked) the quantisers read x's rows in place: y and
    dw are the op's over the gathered copy x[rows] bit for bit, and dx is that op's dx summed per token, expert
    by expert in fp32 (one add per token per expert, so the sum's order is the experts')."""
    from tests.ops.test_grouped_mm import _routed
    x, w, offs, rows = _routed(T=150, K=200, N=136, k=3, E=6)
    x, w = x.detach(), w.detach() * 200 ** -0.5
    dy = torch.randn(rows.shape[0], 136)
    y = OP(x, w, offs, rows)
    dx, dw = BWD(dy, x, w, offs, rows)
    assert torch.equal(y, OP(x[rows], w, offs))
    dxs, dw_ref = BWD(dy, x[rows], w, offs)
    assert torch.equal(dw, dw_ref) and bool((dw[0] == 0).all())
    assert torch.equal(dx, torch.zeros_like(x).index_add_(0, rows, dxs))
    torch.library.opcheck(OP, (x.requires_grad_(), w, offs, rows))
    torch.library.opcheck(BWD, (dy, x.detach(), w, offs, rows))


def test_the_model_makes_no_row_per_assignment():
    """The routed experts read the token rows in place (``rows``) and add their outputs into the tokens
    (``grouped_mm_combine``): the MoE's forward gathers nothing of [T*k, h], and gives the output and gradients
    of the copy-GEMM-gather path the expert-parallel dispatch keeps (rows sent to other ranks must exist): to
    fp32 rounding with unquantised experts, within the FP8 experts' error with FP8 (the fused backward quantises
    each token's gradient before the routing weight scales it)."""
    from glm52_model.model import MoE, combine_experts, expert_rows
    from sacpass.testing import OpCounter
    torch.manual_seed(0)
    for fp8_experts in (True, False):
        cfg = GLM52Config.tiny(fp8_experts=fp8_experts, mtp_layers=0)
        moe = MoE(cfg)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
        x = torch.randn(40, cfg.hidden_size, requires_grad=True)
        with OpCounter("aten::index.Tensor", "aten::gather", "aten::index_select") as calls:
            out = moe.experts(x, *moe.route(x))
        assert calls.count("forward", "aten::index") == 0, calls.counts
        dy = torch.randn_like(out)
        out.backward(dy)
        got = {"x": x.grad, **{n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}}
        moe.zero_grad()
        x2 = x.detach().requires_grad_()
        expert, weight = moe.route(x2)
        order = torch.argsort(expert.flatten(), stable=True)
        offs = torch.bincount(expert.flatten(), minlength=cfg.num_experts).cumsum(0).to(torch.int32)
        ref = combine_experts(moe.grouped_ffn(expert_rows(x2, order), offs), weight, order)
        ref.backward(dy)
        want = {"x": x2.grad, **{n: p.grad for n, p in moe.named_parameters() if p.grad is not None}}
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        assert got.keys() == want.keys() and {"gate", "w_gate", "w_up", "w_down"} <= got.keys()
        for n in want:
            if fp8_experts:
                assert_similar(got[n], want[n], min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what=n)
            else:
                # fp32 sums in other orders (by expert; dweight as <hidden row, its dgrad>), equally far from
                # float64: tests/ops/test_grouped_mm.py::test_combine_is_as_close_to_float64_as_the_gather
                torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


FP8_COMBINE, FP8_COMBINE_BWD = torch.ops.glm52.fp8_grouped_mm_combine, torch.ops.glm52.fp8_grouped_mm_combine_bwd


def test_combine_forward_is_the_rows_summed_by_expert_bit_for_bit():
    """The FP8 combine's output is the FP8 op's rows (the same quantised GEMMs, one expert-sized buffer)
    weighted and added into their tokens in expert order: the CPU's sequential index_add over the rows in
    order makes the same adds. K and N not multiples of 128, an empty expert."""
    from tests.ops.test_grouped_mm import _combined
    x, w, offs, order, weight = _combined(T=90, K=200, N=136, k=3, E=6, seed=2)
    out = FP8_COMBINE(x, w, offs, order, weight)
    rows = OP(x, w, offs)
    ref = torch.zeros(90, 136).index_add_(0, order // 3, rows * weight.flatten()[order][:, None])
    assert out.shape == (90, 136) and torch.equal(out, ref)


def test_combine_fp8_vs_fp32_forward_and_all_grads():
    """Forward and the three gradients (hidden rows, expert weights, routing weights) within the FP8
    experts' error of the unquantised rows-then-gather path; opcheck of both ops."""
    from tests.ops.test_grouped_mm import against_unfused
    out, ref, grads, (x, w, *_), _ = against_unfused(FP8_COMBINE, FP8_COMBINE_BWD, T=150, K=256, N=200, k=4, E=7,
                                                     seed=4)
    assert_similar(out, ref, min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what="out")
    for got, want, what in grads:
        assert_similar(got, want, min_cos=FP8_MIN_COS, max_rel=FP8_MAX_REL, what=what)
    assert bool((w.grad[0] == 0).all())


def test_pair_is_two_grouped_gemms_of_the_same_rows():
    """glm52::fp8_grouped_mm_pair (the SwiGLU's gate and up, x quantised once) gives the single op's outputs and
    weight gradients bit for bit, with and without ``rows``; dx is the two dgrads summed per row before it is
    written (with ``rows``: summed into each token in fp32 expert by expert, as the CPU's sequential index_add of
    the two single ops' row gradients does); opcheck of both ops."""
    from tests.ops.test_grouped_mm import _routed
    x, w1, offs, rows = _routed(T=150, K=200, N=136, k=3, E=6)
    x, w1 = x.detach(), w1.detach() * 200 ** -0.5
    w2 = torch.randn_like(w1) * 200 ** -0.5
    dy1, dy2 = torch.randn(rows.shape[0], 136), torch.randn(rows.shape[0], 136)
    PAIR, PAIR_BWD = torch.ops.glm52.fp8_grouped_mm_pair, torch.ops.glm52.fp8_grouped_mm_pair_bwd
    for r, xs in ((rows, x[rows]), (None, x[rows])):
        xin = x if r is not None else xs
        y1, y2 = PAIR(xin, w1, w2, offs, r)
        assert torch.equal(y1, OP(xs, w1, offs)) and torch.equal(y2, OP(xs, w2, offs))
        dx, dw1, dw2 = PAIR_BWD(dy1, dy2, xin, w1, w2, offs, r)
        (g1, ref1), (g2, ref2) = BWD(dy1, xs, w1, offs), BWD(dy2, xs, w2, offs)
        assert torch.equal(dw1, ref1) and torch.equal(dw2, ref2)
        summed = g1 + g2
        want = summed if r is None else torch.zeros_like(x).index_add_(0, rows, summed)
        assert torch.equal(dx, want)
        torch.library.opcheck(PAIR, (xin.clone().requires_grad_(), w1, w2, offs, r))
        torch.library.opcheck(PAIR_BWD, (dy1, dy2, xin, w1, w2, offs, r))
