"""ModelPlan(compress="fp8" / "int8"): the 8-bit packing of the values a model plan sends to the host (lossy, off by
default).

The codec, in either format: each tile of 128 elements within the bound its docstring states, whatever the length,
layout or dtype; zeros stay zeros, a non-finite tile comes back NaN, integer values are refused. The plan: the packed
bytes are what the host holds and the copies move, values kept on the device are not packed, the planner
counts packed bytes (so a host budget that holds half of the raw values holds all of them packed), and the
gradients stay close to eager's while differing from them (the backward really reads the rebuilt values).
The Triton kernels against this reference: tests/gpu/test_compression_cuda.py.
"""
from __future__ import annotations

import pytest
import torch

import sacpass
import sacpass.offload as rt
from sacpass.offload.placement import Budgets, place_step
from sacpass.compression import TILE, pack, packed_bytes, unpack
from tests.support.helpers import relative_error
from test_model_plan import LAYERS, REGION, _eager, _plan, _run


def _bound(x: torch.Tensor, fmt: str = "fp8") -> torch.Tensor:
    """Per element, the error the packing may make: fp8, 1/16 of its magnitude, and e4m3's subnormal step below;
    int8, half a step of 1/127 of its tile's largest magnitude (and the fp32 division's rounding)."""
    flat = x.reshape(-1).float()
    pad = -flat.numel() % TILE
    amax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, TILE).amax(-1)
    tile_amax = amax.repeat_interleave(TILE)[:flat.numel()]
    if fmt == "int8":
        return (tile_amax / 254 * (1 + 1e-5)).view(x.shape)
    return (flat.abs() / 16 + tile_amax * 2.0 ** -10).view(x.shape)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1,), (127,), (1000,), (3, 257), (64, 128)])
def test_a_packed_value_comes_back_within_the_tile_bound(dtype, shape, fmt):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    q, s = pack(x, fmt)
    assert q.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[fmt] and q.numel() == x.numel()
    assert s.dtype == torch.float32 and s.numel() == -(-x.numel() // TILE)
    assert q.numel() + 4 * s.numel() == packed_bytes(x.numel())
    y = unpack(q, s, torch.empty_like(x))
    err = (y.float() - x.float()).abs()
    assert bool((err <= _bound(x, fmt) + x.float().abs() * torch.finfo(dtype).eps).all()), err.max()
    assert x.numel() == 1 or not torch.equal(y, x)  # lossy (a lone tile maximum is exact)


def test_int8_is_closer_than_fp8_on_gaussian_tiles_and_coarser_beside_an_outlier():
    """What the two formats trade: int8's absolute step (1/254 of the tile's largest) beats e4m3's relative one
    (1/16 of each element) on Gaussian-like tiles, and loses on small elements sharing a tile with an outlier."""
    g = torch.Generator().manual_seed(0)

    def error(x, fmt):
        return relative_error(unpack(*pack(x, fmt), torch.empty_like(x)), x)

    gauss = torch.randn(64, TILE, generator=g).to(torch.bfloat16)
    outlier = gauss.clone()
    outlier[:, 5] *= 50
    small = torch.ones(TILE, dtype=torch.bool)
    small[5] = False
    assert error(gauss, "int8") < error(gauss, "fp8") / 3

    def small_error(fmt):  # the small elements' error, packed in the tiles of the outlier
        return relative_error(unpack(*pack(outlier, fmt), torch.empty_like(outlier))[:, small], outlier[:, small])
    assert small_error("int8") > 2 * small_error("fp8")


def test_an_unknown_packing_format_is_refused_with_the_choices():
    with pytest.raises(sacpass.OffloadError, match=r"'int4' is not a packing format; pass one of 'fp8', 'int8'"):
        pack(torch.zeros(TILE), "int4")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_a_transposed_value_comes_back_in_its_own_layout(fmt):
    x = torch.randn(256, 96).t()  # dense, not contiguous
    q, s = pack(x, fmt)
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    y = unpack(q, s, out)
    assert y.stride() == x.stride()
    assert bool(((y - x).abs() <= _bound(x, fmt) + 1e-6).all())


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_zeros_stay_zeros_and_a_non_finite_tile_comes_back_nan(fmt):
    x = torch.zeros(3 * TILE)
    x[TILE + 5] = float("inf")
    y = unpack(*pack(x, fmt), torch.empty_like(x))
    assert torch.equal(y[:TILE], x[:TILE]) and torch.equal(y[2 * TILE:], x[2 * TILE:])
    assert bool(torch.isnan(y[TILE + 5]))  # an overflowed step stays visibly broken


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_discrete_values_are_never_packed(dtype):
    with pytest.raises(sacpass.OffloadError, match="never compressed"):
        pack(torch.zeros(256, dtype=dtype))


def test_an_unknown_compression_is_refused_with_the_choices():
    with pytest.raises(sacpass.BackendOptionError, match="'fp8' or 'int8'"):
        sacpass.ModelPlan(layers=2, compress="int4")


def _packed_region() -> int:
    """A toy region's bytes on the host FP8-packed: its fp32 values, one by one (the decisions list them)."""
    _, _, _, be = _run(_plan(0, 1 << 20), steps=1)
    return sum(packed_bytes(d.bytes // 4) for d in be.reports[0].decisions if d.action == "offload")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_host_holds_and_the_copies_move_the_packed_bytes(fmt):
    packed = _packed_region()
    assert packed < 0.27 * REGION  # fp32 values: a byte and 1/32 of a scale per element
    grads, st, rows, _ = _run(_plan(REGION, 1 << 20, compress=fmt, exact=()))
    assert [r["device_bytes"] for r in rows] == [0] * (LAYERS - 1) + [REGION]  # kept as they are
    assert [r["host_bytes"] for r in rows] == [packed] * (LAYERS - 1) + [0]
    assert st.offloaded_bytes == st.reloaded_bytes == (LAYERS - 1) * packed
    assert st.packed_bytes == (LAYERS - 1) * REGION and st.kept_bytes == REGION
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()
    ref = _eager()
    for a, b in zip(grads[-1], ref):
        assert relative_error(a, b) < 0.1
    assert any(not torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads[-1], ref))


def test_the_backward_reads_the_values_rebuilt_from_the_format_the_plan_names():
    """compress="int8" and "fp8" pack the same values: each step's gradients near eager's, and not each other's
    (the runtime packs in the plan's format, the decisions name it)."""
    fp8, _, _, be8 = _run(_plan(0, 1 << 20, compress="fp8", exact=()))
    int8, _, _, bei = _run(_plan(0, 1 << 20, compress="int8", exact=()))
    assert all("INT8-packed" in d.why for d in bei.reports[0].decisions)
    assert all("FP8-packed" in d.why for d in be8.reports[0].decisions)
    ref = _eager()
    for a, b, r in zip(fp8[-1], int8[-1], ref):
        assert relative_error(a, r) < 0.1 and relative_error(b, r) < 0.1
    assert any(not torch.equal(a, b) for a, b in zip(fp8[-1], int8[-1]))


def test_the_default_plan_sends_values_as_they_are():
    grads, st, _, _ = _run(_plan(0, 1 << 20))
    assert st.packed_bytes == 0 and st.offloaded_bytes == LAYERS * REGION
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(grads[-1], _eager()))


def test_the_planner_counts_packed_bytes_against_the_host_budget():
    host = LAYERS * REGION // 2  # half the raw values
    _, _, _, exact = _run(_plan(0, host), steps=1)
    _, _, _, packed = _run(_plan(0, host, compress="fp8", exact=()), steps=1)
    actions = lambda be: [d.action for d in be.reports[0].decisions]  # noqa: E731
    assert "recompute" in actions(exact)
    assert set(actions(packed)) == {"offload"}
    assert all("FP8-packed" in d.why for d in packed.reports[0].decisions)


def test_a_packed_step_the_host_cannot_hold_names_the_device_budget_in_unpacked_bytes():
    """The device keeps values as they are: the smallest gpu_bytes that holds a packed step counts them so,
    not at the host's packed size."""
    sizes = {(0, 0): 4096, (1, 0): 4096}  # fp32 values of 1024 elements: 1024 + 512 pool bytes packed
    host_sizes = {k: rt.packed_pool_bytes(1024) for k in sizes}
    with pytest.raises(sacpass.OffloadError, match=r"host_bytes=3072 with this gpu_bytes, or gpu_bytes=4096 with "
                                                   r"this host_bytes"):
        place_step(sizes, Budgets(2, 0, 2176), host_sizes)
    assert place_step(sizes, Budgets(2, 4096, 2176), host_sizes) == \
        {(1, 0): "device", (0, 0): "host"}


def test_exact_values_go_to_the_host_unpacked_and_the_planner_counts_their_bytes():
    """exact="aten::bmm": the region's two bmm outputs (3072 and 384 bytes) go as they are, the rest packed; the
    decisions say which and why, the host holds and the copies move exactly that."""
    packed_others = sum(packed_bytes(d.bytes // 4) for d in _run(_plan(0, 1 << 20), steps=1)[3].reports[0].decisions
                        if d.action == "offload" and not d.op.startswith("aten::bmm"))
    _, st, rows, be = _run(_plan(0, 1 << 20, compress="fp8", exact="aten::bmm"))
    by_op = {d.name: d for d in be.reports[0].decisions}
    exact = [d for d in by_op.values() if d.exact]
    assert sorted(d.name for d in exact) == ["bmm", "bmm_1"] and {d.exact for d in exact} == {"aten::bmm"}
    assert all(d.action == "offload" and d.why.endswith("on the host unpacked (exact=aten::bmm)") for d in exact)
    assert all("FP8-packed" in d.why for d in by_op.values() if not d.exact)
    assert [r["host_bytes"] for r in rows] == [packed_others + 3072 + 384] * LAYERS
    assert st.packed_bytes == LAYERS * (REGION - 3072 - 384)
    assert st.offloaded_bytes == LAYERS * (packed_others + 3072 + 384)


def test_exact_for_every_planned_op_sends_nothing_packed_and_the_grads_are_eager_s():
    """With the inputs kept on the device and every planned op named exact, compress="fp8" packs nothing: the
    gradients equal eager's (they differ where the values go packed)."""
    ops = ("aten::bmm", "aten::addmm", "aten::mm")
    grads, st, _, _ = _run(_plan(0, 1 << 20, compress="fp8", exact=ops, inputs=False))
    assert st.packed_bytes == 0 and st.offloaded_bytes > 0
    ref = _eager()
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(grads[-1], ref))
    grads, st, _, _ = _run(_plan(0, 1 << 20, compress="fp8", exact=ops[:1], inputs=False))
    assert st.packed_bytes > 0
    assert any(not torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads[-1], ref))


def test_an_exact_selector_that_names_no_planned_value_is_reported_like_an_unmatched_selector():
    from sacpass.testing import no_compile_caches
    from test_model_plan import _x
    from tests.support.toy import CompiledStack, stack_step

    plan = _plan(0, 1 << 20, compress="fp8", exact=("aten::bmm", "aten::topk"))
    with no_compile_caches():
        model = CompiledStack(sacpass.backend(inner="aot_eager", plan=plan), LAYERS, 0)
        with pytest.raises(sacpass.UnmatchedSelectorError, match=r"aten::topk matched no .*ModelPlan\(exact=aten::topk\) "
                                                                 r"names none of the values its planner weighed"):
            stack_step(model, _x())


def test_exact_takes_op_selectors_with_compress_only():
    with pytest.raises(sacpass.BackendOptionError, match=r"exact=aten::bmm\) names values kept bit for bit.*Pass "
                                                         r"compress='fp8' \(or 'int8'\), or drop exact="):
        sacpass.ModelPlan(layers=2, exact="aten::bmm")
    with pytest.raises(sacpass.BackendOptionError, match="not an op name"):
        sacpass.ModelPlan(layers=2, compress="fp8", exact=lambda node: True)
    plan = sacpass.ModelPlan(layers=2, compress="fp8", exact=["aten::bmm", torch.ops.aten.mm.default, "attn::aten::bmm"])
    assert [str(s) for s in plan.exact] == ["aten::bmm", "aten::mm.default", "attn::aten::bmm"]
    assert plan != sacpass.ModelPlan(layers=2, compress="fp8") and hash(plan) == hash(
        sacpass.ModelPlan(layers=2, compress="fp8", exact=("aten::bmm", "aten::mm.default", "attn::aten::bmm")))


# ------------------------------------------------------------------- what the backward is sensitive to
class _SoftmaxAttention(torch.nn.Module):
    """q, k, v projections and a softmax attention, checkpointed: its backward reads the softmax output with
    its gradient (``sum(y * dy)`` along each row)."""

    def __init__(self, dim=64):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        def body(x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return x + self.o(torch.softmax(q @ k.T / 8, dim=-1) @ v)
        return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)


def _attention_decisions(exact):
    from sacpass.testing import no_compile_caches

    torch.manual_seed(0)
    layer = _SoftmaxAttention()
    plan = sacpass.ModelPlan(layers=1, gpu_bytes=0, host_bytes=1 << 30, min_offload_bytes=0, compress="fp8",
                             exact=exact, cost=sacpass.CostModel())
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        torch.compile(layer, backend=be, fullgraph=True)(torch.randn(96, 64, requires_grad=True)).sum().backward()
    return [d for d in be.reports[0].decisions if d.op != "input"]


def test_by_default_a_value_the_backward_sums_times_its_gradient_goes_unpacked():
    """The softmax output's backward takes sum(y * dy) per row; the plan keeps the attention scores (q @ k.T),
    from which the backward recomputes it, exact. The projections' outputs, read by matrix multiplies, go packed.
    exact=() packs them all."""
    default = _attention_decisions(None)
    (scores,) = [d for d in default if d.exact]
    assert scores.op == "aten::mm.default" and scores.bytes == 96 * 96 * 4 and scores.action == "offload"
    assert scores.exact == "sensitive: aten::_softmax_backward_data reads it with its gradient", scores
    assert scores.why.endswith("on the host unpacked (aten::_softmax_backward_data reads it with its gradient)")
    packed = [d for d in default if not d.exact and d.action == "offload"]
    assert packed and all("FP8-packed" in d.why for d in packed)
    everything = _attention_decisions(())
    assert not any(d.exact for d in everything) and all("FP8-packed" in d.why for d in everything
                                                         if d.action == "offload")


class _CheckpointedMoE(torch.nn.Module):
    """The tiny GLM-5.2's MoE (bf16-path grouped GEMMs on the CPU) in a checkpointed residual block."""

    def __init__(self):
        from glm52_model import GLM52Config
        from glm52_model.model import MoE

        super().__init__()
        self.moe = MoE(GLM52Config.tiny(num_layers=1, mtp_layers=0))
        for p in self.moe.parameters():
            torch.nn.init.normal_(p, std=0.05)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda x: x + self.moe(x), x, use_reentrant=False)


def test_by_default_the_expert_hidden_rows_a_routing_weight_gradient_reads_go_unpacked():
    """The routed experts' down GEMM and weighted sum into tokens is one op (glm52::grouped_mm_combine); its
    backward takes each routing weight's gradient as <hidden row, W_down^T dout[token]>, one value per row of the
    hidden rows. The plan keeps what the hidden rows are recomputed from (the gate and up GEMMs' outputs) exact by
    default, and nothing else, and the router's and the down weights' gradients come out closer to the exact plan's
    than with every value packed."""
    from sacpass.testing import no_compile_caches

    torch.manual_seed(0)
    block = _CheckpointedMoE()
    x0 = torch.randn(64, block.moe.gate.shape[1])

    def run(**kw):
        plan = sacpass.ModelPlan(layers=1, gpu_bytes=0, host_bytes=1 << 30, min_offload_bytes=0,
                                 cost=sacpass.CostModel(), **kw)
        with no_compile_caches():
            be = sacpass.backend(inner="aot_eager", plan=plan)
            compiled = torch.compile(block, backend=be, fullgraph=True)
            for _ in range(2):  # the first places from estimates, the second from the first step's sizes
                block.zero_grad(set_to_none=True)
                compiled(x0.clone().requires_grad_()).square().sum().backward()
        return {n: p.grad.clone() for n, p in block.named_parameters()}, be.reports[-1].decisions

    exact, _ = run()
    default, decisions = run(compress="fp8")
    packed, _ = run(compress="fp8", exact=())
    (pair,) = [d for d in decisions if d.op.startswith("glm52::grouped_mm_pair")]
    assert pair.action == "offload" and pair.exact == (
        "sensitive: glm52::grouped_mm_combine_bwd returns one value per row of it from its gradient"), pair
    assert "on the host unpacked" in pair.why
    assert [d for d in decisions if d.exact] == [pair], decisions  # the shared expert's GEMM outputs go packed
    for name in ("moe.gate", "moe.w_down"):
        assert relative_error(default[name], exact[name]) < 0.8 * relative_error(packed[name], exact[name]), name


@pytest.mark.slow  # the softmax case above covers the rule quickly
def _tiny_glm(**overrides):
    """(model, ids): the 2-layer tiny GLM-5.2 (``overrides`` on its config) from seed 0, and 128 token ids."""
    from glm52_model import GLM52Config, GLM52ForCausalLM

    torch.manual_seed(0)
    base = GLM52ForCausalLM(GLM52Config.tiny(num_layers=2, mtp_layers=0, **overrides))
    return base, torch.randint(0, base.cfg.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))


def _glm_plan_steps(base, ids, **plan_options):
    """(gradients, backend, offload stats) of two steps of a copy of ``base`` compiled under a model plan that
    keeps nothing on the device and holds every value on the host, with ``plan_options``."""
    import copy

    from glm52_model.compile import apply_compile
    from sacpass.testing import no_compile_caches

    plan = sacpass.ModelPlan(layers=2, gpu_bytes=0, host_bytes=1 << 30, min_offload_bytes=0,
                             cost=sacpass.CostModel(), **plan_options)
    rt.reset_stats()
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = apply_compile(copy.deepcopy(base), backend=be, fullgraph=True)
        for _ in range(2):  # the first places from estimates, the second from the first step's sizes
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, be, rt.stats()


def test_the_glm_attention_output_stays_exact_by_default_and_the_gradients_are_closer():
    """Tiny GLM-5.2 under a compressing plan: sparse MLA's output (its backward op reads it with its gradient)
    goes to the host unpacked by default; every parameter's gradient is then closer to the exact plan's than
    with every floating value packed."""
    base, ids = _tiny_glm()
    exact, _, _ = _glm_plan_steps(base, ids)
    default, be, _ = _glm_plan_steps(base, ids, compress="fp8")
    packed, _, _ = _glm_plan_steps(base, ids, compress="fp8", exact=())
    mla = [d for r in be.reports for d in r.decisions if d.op.startswith("glm52::sparse_mla")]
    assert mla and all(d.exact == "sensitive: glm52::sparse_mla_bwd reads it with its gradient" for d in mla), mla
    err = lambda got: max(relative_error(got[n], exact[n]) for n in exact)  # noqa: E731
    assert 0 < err(default) < err(packed), (err(default), err(packed))


def test_a_quantised_form_goes_unpacked_under_any_packing():
    """Tiny GLM-5.2 with FP8 linears: each linear keeps its weight gradient's operand as float8 elements and fp32
    scales (``glm52::fp8_quantize_pair``, exact for that backward); packing would round the scales, each of which
    multiplies a tile. With every other planned value named exact (and the region inputs not placed), a packing
    plan then sends nothing packed, and its gradients are the exact plan's bit for bit."""
    base, ids = _tiny_glm(first_k_dense=0, fp8=True)
    others = ("glm52::sparse_mla", "glm52::grouped_mm_pair", "glm52::fp8_blockwise_mm", "aten::bmm", "aten::mm")
    exact, _, _ = _glm_plan_steps(base, ids, inputs=False)
    got, be, st = _glm_plan_steps(base, ids, inputs=False, compress="int8", exact=others)
    pairs = [d for r in be.reports for d in r.decisions if d.op.startswith("glm52::fp8_quantize_pair")]
    assert pairs and all(d.exact.startswith("quantised: ") for d in pairs), pairs
    sent = [d for d in pairs if d.action == "offload"]
    assert sent and all("on the host unpacked (float8 elements and their scales" in d.why for d in sent), sent
    assert st.packed_bytes == 0, st.format()
    assert all(torch.equal(got[n], exact[n]) for n in exact)
