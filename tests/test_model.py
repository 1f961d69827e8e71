"""glm52_model: config presets, the tiny model eager (FP8 on/off, MTP, shared top-k layer), recompute
equivalence (apply_ac), top-k runs by phase, packing, a parallel rank's forward (global loss normalisation),
meta-device GLM-5.2 size, and compiled layers (apply_compile: aot_eager, fullgraph) matching eager with 0
graph breaks and no recompile across lengths."""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from glm52_model import GLM52Config, GLM52ForCausalLM
from glm52_model.compile import apply_ac, apply_compile
from glm52_model.config import PRESETS
from glm52_model.parallel import ParallelCausalLM, ParallelDims, shard_batch
from sacpass.testing import OpCounter

TOPK_OP = "glm52::dsa_topk_indices"

PUBLISHED_GLM5_TOTAL = 744e9          # published total parameter count (main model, MTP excluded)
PUBLISHED_TOLERANCE = 0.01            # our analytic count must be within 1% of it
FP8_LOSS_RTOL = 0.01                  # FP8 vs bf16/fp32 loss at init (loss ~ ln(vocab))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls gain nothing from 2 OpenMP threads and thrash when the 2 cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(cfg, S, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _model(**overrides):
    torch.manual_seed(0)
    return GLM52ForCausalLM(GLM52Config.tiny(**overrides))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------- config
def test_presets_and_layer_kinds():
    g = GLM52Config.glm52()
    assert g.full_topk_layers()[:5] == [0, 1, 2, 6, 10] and g.full_topk_layers()[-1] == 74
    assert len(g.full_topk_layers()) == 21 and g.kv_latent_dim == 576
    t = GLM52Config.tiny()
    kinds = [(t.is_moe_layer(i), t.is_full_topk_layer(i)) for i in range(t.num_layers)]
    assert kinds == [(False, True), (True, True), (True, False)]  # dense, MoE full, MoE shared
    assert t.mtp_layers == 1
    for preset in (GLM52Config.tiny, GLM52Config.bench, GLM52Config.glm52):
        assert preset().recompute is True and preset(fp8=True).fp8 is True
    for name in PRESETS:
        assert GLM52Config.preset(name, fp8=True) == getattr(GLM52Config, name)(fp8=True)
    # the bench preset's FP8 recipe covers the routed experts unless told otherwise; the others keep them bf16
    assert GLM52Config.bench(fp8=True).fp8_experts is True and GLM52Config.bench().fp8_experts is False
    assert GLM52Config.bench(fp8=True, fp8_experts=False).fp8_experts is False
    assert GLM52Config.tiny(fp8=True).fp8_experts is False


def test_config_errors():
    with pytest.raises(TypeError, match="unknown option.*'hidden'"):
        GLM52Config.tiny(hidden=3)
    with pytest.raises(ValueError, match="mtp_layers=2"):
        GLM52Config.tiny(mtp_layers=2)
    with pytest.raises(ValueError, match="index_topk_offset=0"):
        GLM52Config.tiny(index_topk_offset=0)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        GLM52Config.tiny(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="unknown preset 'nope'; valid presets are tiny, bench, glm52"):
        GLM52Config.preset("nope")
    with pytest.raises(TypeError, match="unknown option.*'layers'"):
        GLM52Config.preset("tiny", layers=2)


def test_glm52_on_meta_device_param_count():
    cfg = GLM52Config.glm52()
    with torch.device("meta"):
        model = GLM52ForCausalLM(cfg)
    main, total = model.num_params(include_mtp=False), model.num_params()
    print(f"\nGLM-5.2 on meta: {main / 1e9:.2f}B main + {(total - main) / 1e9:.2f}B MTP = {total / 1e9:.2f}B")
    assert main == cfg.expected_num_params(include_mtp=False)
    assert total == cfg.expected_num_params(include_mtp=True)
    assert abs(main - PUBLISHED_GLM5_TOTAL) / PUBLISHED_GLM5_TOTAL < PUBLISHED_TOLERANCE
    assert 700e9 < main < total < 800e9                                           # sanity bounds
    assert sum(layer.attn.indexer is not None for layer in model.layers) == 21


# ------------------------------------------------------------------------------------------------ eager
@pytest.mark.parametrize("fp8", [False, True])
def test_eager_forward_backward(fp8):
    model = _model(fp8=fp8)
    assert model.layers[2].attn.indexer is None and model.mtp[0].block.attn.indexer is None
    ids, labels = _batch(model.cfg, 64)
    loss = model(ids, labels=labels)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item() * (1 + model.cfg.mtp_loss_weight)) < 0.5
    for name, p in model.named_parameters():
        if ".indexer." in name:                                                  # runs under no_grad
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert float(model.mtp[0].eh_proj.weight.grad.abs().sum()) > 0
    if fp8:
        ref = _model(fp8=False)
        torch.testing.assert_close(loss, ref(ids, labels=labels), rtol=FP8_LOSS_RTOL, atol=0.0)


def test_the_experts_rows_go_out_and_come_back_by_assignment_without_accumulating_in_place():
    """expert_rows / combine_experts against their definition in float64: assignment a = t*k + j is token t's
    j-th expert; row i of the sorted rows is assignment order[i]. Out: token order[i] // k's row. Back: each
    token's weighted sum over its k rows. Gradients as the gather and index_add they replace; and the same
    bits from two runs of the same backward (no atomics to reorder the sums)."""
    from glm52_model.model import combine_experts, expert_rows

    g = torch.Generator().manual_seed(0)
    T, k, h = 37, 4, 24
    x = torch.randn(T, h, dtype=torch.float64, generator=g, requires_grad=True)
    order = torch.randperm(T * k, generator=g)
    weight = torch.rand(T, k, dtype=torch.float64, generator=g, requires_grad=True)
    ys = torch.randn(T * k, h, dtype=torch.float64, generator=g, requires_grad=True)
    out_rows, out = expert_rows(x, order), combine_experts(ys, weight, order)
    assert torch.equal(out_rows, x[order // k])
    reference = torch.zeros(T, h, dtype=torch.float64).index_add(0, order // k, ys * weight.flatten()[order, None])
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    dy = torch.randn(T, h, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((out_rows.sum(1) * 0.5).sum() + (out * dy).sum(), (x, weight, ys))
    want = torch.autograd.grad((x[order // k].sum(1) * 0.5).sum() + (reference * dy).sum(), (x, weight, ys))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    rerun = (expert_rows(x, order).sum(1) * 0.5).sum() + (combine_experts(ys, weight, order) * dy).sum()
    again = torch.autograd.grad(rerun, (x, weight, ys))
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_recompute_on_off_equal():
    on, off = _model(recompute=True), _model(recompute=False)
    off.load_state_dict(on.state_dict())
    ids, labels = _batch(on.cfg, 64)
    l_on, l_off = on(ids, labels=labels), off(ids, labels=labels)
    l_on.backward(), l_off.backward()
    torch.testing.assert_close(l_on, l_off, rtol=0, atol=0)
    g_on, g_off = _grads(on), _grads(off)
    assert g_on.keys() == g_off.keys()
    for n in g_on:
        torch.testing.assert_close(g_on[n], g_off[n], rtol=1e-6, atol=1e-7, msg=n)


def test_apply_ac_switches_recompute():
    full = len(GLM52Config.tiny().full_topk_layers())
    assert full == 2
    ids, labels = _batch(GLM52Config.tiny(), 32)
    model = _model()
    for enabled, expected_bwd in ((True, full), (False, 0), (True, full)):
        apply_ac(model, enabled)
        with OpCounter(TOPK_OP) as topk:
            model(ids, labels=labels).backward()
        assert topk.forward == full                                              # one per full layer
        assert topk.backward == expected_bwd                                     # eager AC replays them


def test_parallel_ranks_losses_add_up_to_the_global_loss():
    """Two data-parallel ranks (one sequence each, no collectives needed): each passes positions, key
    ranges, MTP targets and the global label counts; their losses and gradients add up to the model's."""
    model = _model()
    ids, labels = _batch(model.cfg, 24)
    labels[0, 5:9] = -100                                                        # uneven valid counts
    model(ids, labels=labels).backward()
    ref = _grads(model)
    ref_loss = model(ids, labels=labels).detach()
    model.zero_grad()
    wrapper, dims = ParallelCausalLM(model), ParallelDims(world=2)
    total = sum(wrapper(shard_batch(ids, labels, dims, rank)) for rank in range(2))
    total.backward()
    torch.testing.assert_close(total, ref_loss, rtol=1e-6, atol=1e-6)
    got = _grads(model)
    assert got.keys() == ref.keys()
    for n in ref:  # fp32 GEMMs over one sequence's rows and over both round apart by ~1e-7
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_rank_inputs_are_checked():
    model = _model()
    ids, labels = _batch(model.cfg, 8, B=1)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="positions, starts and ends together"):
        model(ids, labels, positions=pos)
    with pytest.raises(ValueError, match="pass mtp_targets too"):
        model(ids, labels, positions=pos, starts=torch.zeros(8, dtype=torch.int32), ends=(pos + 1).int())


def test_shared_layer_needs_ids():
    model = _model()
    x = torch.randn(8, model.cfg.hidden_size)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="shares top-k IDs"):
        model.layers[2](x, pos, torch.zeros(8, dtype=torch.int32), (pos + 1).int())


def test_packed_sequences_do_not_attend_across():
    model = _model(recompute=False)
    ids, _ = _batch(model.cfg, 40, B=1)
    ids = ids[0]
    cu = torch.tensor([0, 16, 40], dtype=torch.int32)
    with torch.no_grad():
        logits = model(ids, cu_seqlens=cu)
        changed = ids.clone()
        changed[16:] = (changed[16:] + 1) % model.cfg.vocab_size
        logits2 = model(changed, cu_seqlens=cu)
        batched = model(torch.stack([ids[:20], ids[20:]]))                        # [2, 20] == cu [0,20,40]
        packed = model(ids, cu_seqlens=torch.tensor([0, 20, 40]))
    torch.testing.assert_close(logits[:16], logits2[:16], rtol=0, atol=0)
    assert not torch.allclose(logits[16:], logits2[16:])
    torch.testing.assert_close(batched.view(40, -1), packed, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- compile
def _compiled_vs_eager(fp8, lengths, dynamic_tokens, graphs=3, **overrides):
    eager = _model(fp8=fp8, **overrides)
    compiled = apply_compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True,
                             dynamic_tokens=dynamic_tokens)
    with pytest.raises(ValueError, match="compiled already"):
        apply_compile(compiled, backend="aot_eager")
    counters.clear()
    full = len(eager.cfg.full_topk_layers())
    for S in lengths:
        ids, labels = _batch(eager.cfg, S, seed=S)
        eager.zero_grad(), compiled.zero_grad()
        l_e = eager(ids, labels=labels)
        l_e.backward()
        with OpCounter(TOPK_OP) as topk:
            l_c = compiled(ids, labels=labels)
            l_c.backward()
        # control (no sacpass): the compiled checkpoint recomputes every full layer's top-k in backward
        assert (topk.forward, topk.backward) == (full, full)
        torch.testing.assert_close(l_c, l_e, rtol=1e-5, atol=1e-5)
        g_e, g_c = _grads(eager), _grads(compiled)
        assert g_e.keys() == g_c.keys()
        for n in g_e:
            torch.testing.assert_close(g_c[n], g_e[n], rtol=1e-4, atol=1e-5, msg=n)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one graph per layer kind: dense+full, MoE+full, MoE+shared (layer 2 and the MTP block share it)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


@pytest.mark.slow
def test_compiled_layers_match_eager_two_lengths_no_recompile():
    _compiled_vs_eager(fp8=False, lengths=(64, 96), dynamic_tokens=True)


@pytest.mark.slow
def test_compiled_layers_fp8_match_eager():
    # FP8 changes only the Linears: two layer kinds (dense+full, MoE+full) cover them at lower cost.
    _compiled_vs_eager(fp8=True, lengths=(64,), dynamic_tokens=False, graphs=2, num_layers=2, mtp_layers=0)
