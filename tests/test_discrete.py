"""Discrete decisions are never re-made in the backward: sacpass's default saves them."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass.testing import OpCounter
from tests.support.toy import assert_close_lists, grads_of

DISCRETE = ("aten::topk", "aten::sort", "aten::argmax", "aten::max", "glm52::dsa_topk_indices",
            "sacpass_toy::drifting_topk")


# ------------------------------------------------------------------------------------------ models
class Router(nn.Module):
    """A toy MoE: sigmoid router, top-k experts, weights gathered from the scores and normalised."""

    def __init__(self, dim=16, experts=6, k=2):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) * dim ** -0.5)
        self.k = k

    def body(self, x):
        scores = self.gate(x).sigmoid()                                   # [T, E]
        expert = torch.topk(scores, self.k, dim=-1).indices               # [T, k]
        weight = scores.gather(1, expert)
        weight = weight / weight.sum(-1, keepdim=True)
        ys = torch.einsum("td,tkde->tke", x, self.experts[expert])        # [T, k, D]
        return x + (ys * weight[..., None]).sum(1)

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


class TopkValues(nn.Module):
    """Uses the top-k *values* (softmax over them) and max.dim values: both must be rebuilt, never saved."""

    def __init__(self, dim=16):
        super().__init__()
        self.w = nn.Linear(dim, dim)

    def body(self, x):
        h = self.w(x)
        vals, ids = h.topk(4, dim=-1)
        m, _ = h.max(-1, keepdim=True)
        return h * vals.softmax(-1).sum(-1, keepdim=True) + m + torch.gather(h, -1, ids).mean()

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


_CALLS = [0]


@torch.library.custom_op("sacpass_toy::drifting_topk", mutates_args=())
def drifting_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A top-k whose answer changes between calls (every other call ranks the other way): recompute drift,
    as a different reduction order or a tie can cause it, made certain."""
    _CALLS[0] += 1
    sign = 1.0 if _CALLS[0] % 2 else -1.0
    return torch.topk(sign * scores, k, dim=-1).indices


@drifting_topk.register_fake
def _(scores, k):
    return scores.new_empty((*scores.shape[:-1], k), dtype=torch.int64)


class DriftingRouter(Router):
    def body(self, x):
        scores = self.gate(x).sigmoid()
        with torch.no_grad():
            expert = torch.ops.sacpass_toy.drifting_topk(scores, self.k)
        weight = scores.gather(1, expert)
        ys = torch.einsum("td,tkde->tke", x, self.experts[expert])
        return x + (ys * weight[..., None]).sum(1)


def _step(model, x):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with OpCounter(*DISCRETE) as calls:
        out = model(x)
        out.square().sum().backward()
    return out.detach(), grads_of(model, x), calls


def _eager_no_checkpoint(model, x):
    ref = copy.deepcopy(model)
    ref.forward = ref.body  # the same math, nothing recomputed
    return _step(ref, x)


# ------------------------------------------------------------------------------------------ the default
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_router_topk_kept_by_default(inner):
    torch.manual_seed(0)
    model, x = Router(), torch.randn(24, 16)
    out_e, grads_e, _ = _eager_no_checkpoint(model, x)
    be = sacpass.backend(inner=inner)  # no selectors at all
    out_c, grads_c, calls = _step(torch.compile(copy.deepcopy(model), backend=be, fullgraph=True), x)
    assert calls.backward == 0, calls.counts
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    kept = [s for s in rep.saved if s.reason == "discrete"]
    assert [(s.op, s.dtype, s.shape) for s in kept] == [("aten::topk.default", "int32", ("24", "2"))], rep.format()
    assert kept[0].bytes == 24 * 2 * 4 and rep.bytes_by_reason()["discrete"] == kept[0].bytes
    assert "discrete" in rep.policy


def test_values_rebuilt_from_indices_never_saved():
    torch.manual_seed(0)
    model, x = TopkValues(), torch.randn(12, 16)
    out_e, grads_e, _ = _eager_no_checkpoint(model, x)
    be = sacpass.backend(inner="aot_eager")
    out_c, grads_c, calls = _step(torch.compile(copy.deepcopy(model), backend=be, fullgraph=True), x)
    assert calls.backward == 0, calls.counts
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    kept = sorted((s.op, s.dtype, s.shape) for s in rep.saved if s.reason == "discrete")
    assert kept == [("aten::max.dim", "int32", ("12", "1")), ("aten::topk.default", "int32", ("12", "4"))]
    assert not any(s.op in ("aten::topk.default", "aten::max.dim") and s.dtype != "int32" for s in rep.saved)
    assert rep.recomputed.get("aten::gather.default", 0) >= 1  # the top-k values, rebuilt in the backward


def test_explicit_recompute_overrides_the_default_and_the_audit_warns():
    torch.manual_seed(0)
    model, x = Router(), torch.randn(24, 16)
    be = sacpass.backend(inner="aot_eager", recompute=["aten::topk"])
    with pytest.warns(sacpass.SacpassWarning, match=r"recomputes discrete decision .*aten::topk.default.*"
                                                   r"module <root>.*test_discrete.py:\d+"):
        _, _, calls = _step(torch.compile(copy.deepcopy(model), backend=be, fullgraph=True), x)
    assert calls.count("backward", "aten::topk") == 1
    (rep,) = be.reports
    assert rep.warnings and "aten::topk.default" in rep.warnings[0]
    assert not [s for s in rep.saved if s.reason == "discrete"]


def test_save_discrete_false_turns_the_default_off():
    torch.manual_seed(0)
    be = sacpass.backend(inner="aot_eager", save_discrete=False)
    _, _, calls = _step(torch.compile(Router(), backend=be, fullgraph=True), torch.randn(24, 16))
    assert calls.count("backward", "aten::topk") == 1
    assert "discrete" not in be.reports[0].policy


# ------------------------------------------------- selections whose values only feed another decision
# a score per group of experts, from the experts' scores [T, 8] in 4 groups of 2: the values carry no
# gradient (they only choose groups), so the joint graph holds the selection without its indices
GROUP_SCORES = {
    "max": lambda s: s.view(-1, 4, 2).max(dim=-1).values,  # DeepSeek-V2's group-limited routing
    "min": lambda s: -s.view(-1, 4, 2).min(dim=-1).values,
    "topk": lambda s: s.view(-1, 4, 2).topk(2, dim=-1).values.sum(-1),  # DeepSeek-V3's
    "sort": lambda s: s.view(-1, 4, 2).sort(dim=-1).values[..., 1],
    "kthvalue": lambda s: s.view(-1, 4, 2).kthvalue(2, dim=-1).values,
    "median": lambda s: s.view(-1, 4, 2).median(dim=-1).values,
    "mode": lambda s: s.view(-1, 4, 2).mode(dim=-1).values,
}


class GroupRouter(Router):
    """Group-limited routing: the experts are chosen among the best 2 of 4 groups."""

    def __init__(self, how):
        super().__init__(experts=8)
        self.how = how

    def body(self, x):
        scores = self.gate(x).softmax(-1)                                   # [T, 8]
        group_scores = GROUP_SCORES[self.how](scores)                       # [T, 4]
        groups = group_scores.topk(2, dim=-1).indices                       # [T, 2]
        mask = torch.zeros_like(group_scores).scatter(1, groups, 1.0)       # [T, 4]
        allowed = mask.repeat_interleave(2, dim=-1).bool()                  # [T, 8]
        weight, expert = scores.masked_fill(~allowed, 0.0).topk(self.k, dim=-1)
        ys = torch.einsum("td,tkde->tke", x, self.experts[expert])          # [T, k, D]
        return x + (ys * weight[..., None]).sum(1)


@pytest.mark.parametrize("how", [h if h == "max" else pytest.param(h, marks=pytest.mark.slow) for h in GROUP_SCORES])
def test_a_selection_feeding_only_a_decision_is_kept_as_its_indices(how):
    torch.manual_seed(0)
    model, x = GroupRouter(how), torch.randn(24, 16)
    out_e, grads_e, _ = _eager_no_checkpoint(model, x)
    be = sacpass.backend(inner="aot_eager")
    with OpCounter(f"aten::{how}") as selections:
        out_c, grads_c, calls = _step(torch.compile(copy.deepcopy(model), backend=be, fullgraph=True), x)
    assert calls.backward == 0 and selections.backward == 0, (calls.counts, selections.counts)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    kept = [(s.op.split(".")[0], s.dtype) for s in rep.saved if s.reason == "discrete"]
    assert (f"aten::{how}", "int32") in kept and all(dtype == "int32" for _, dtype in kept), rep.format()


def test_a_custom_decisions_float_outputs_are_kept_as_what_they_are():
    """A custom op's floating outputs cannot be rebuilt from its integer ones: they are kept, and the report
    says why (never a float row with reason discrete)."""
    import tests.support.toy  # noqa: F401  registers sacpass_toy::topk_pair: (values, int32 ids)

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.context_fn = nn.Linear(16, 16), None

        def body(self, x):
            h = self.w(x)
            vals, ids = torch.ops.sacpass_toy.topk_pair(h, 4)
            return h * vals.softmax(-1).sum(-1, keepdim=True) + torch.gather(h, -1, ids.long()).mean()

        def forward(self, x):
            kw = {"context_fn": self.context_fn} if self.context_fn is not None else {}
            return checkpoint(self.body, x, use_reentrant=False, **kw)

    torch.manual_seed(0)
    model, x = Pair(), torch.randn(12, 16)
    _, grads_e, _ = _eager_no_checkpoint(model, x)
    be = sacpass.backend(inner="aot_eager")
    with OpCounter("sacpass_toy::topk_pair") as calls:
        _, grads_c, _ = _step(torch.compile(copy.deepcopy(model), backend=be, fullgraph=True), x)
    assert calls.backward == 0, calls.counts
    assert_close_lists(grads_c, grads_e, rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    rows = sorted((s.dtype, s.reason) for s in rep.saved if s.op.startswith("sacpass_toy::topk_pair"))
    assert rows == [("float32", "decision values"), ("int32", "discrete")], rep.format()
    assert "decision values" in rep.format() and not any(
        s.reason == "discrete" and s.dtype.startswith("float") for s in rep.saved)
    why = [t["selector"] for t in rep.tagged if t["reason"] == "decision values"]
    assert why and all("cannot rebuild" in w for w in why), why
    model.context_fn = be.context_fn()  # in eager, the same
    _, grads_x, calls = _step(model, x)
    assert calls.backward == 0 and sorted((k.dtype, k.reason) for k in model.context_fn.spec.kept) == rows


# ------------------------------------------------------------------------------------------ the hazard
def test_recompute_drift_trains_on_indices_the_forward_never_chose():
    """The plain compiled checkpoint recomputes the router in the backward, where the drifting top-k picks
    other experts: its gradients are those of a routing the forward never used. The default keeps them."""
    torch.manual_seed(0)
    model, x = DriftingRouter(), torch.randn(24, 16)
    _CALLS[0] = 0
    _, grads_e, _ = _eager_no_checkpoint(model, x)

    _CALLS[0] = 0
    plain = sacpass.backend(inner="aot_eager", save_discrete=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sacpass.SacpassWarning)
        _, grads_plain, calls = _step(torch.compile(copy.deepcopy(model), backend=plain, fullgraph=True), x)
    assert calls.count("backward", "sacpass_toy::drifting_topk") == 1
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(grads_plain, grads_e))

    _CALLS[0] = 0
    torch._dynamo.reset()
    default = sacpass.backend(inner="aot_eager")
    _, grads_s, calls = _step(torch.compile(copy.deepcopy(model), backend=default, fullgraph=True), x)
    assert calls.count("backward", "sacpass_toy::drifting_topk") == 0
    assert_close_lists(grads_s, grads_e, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ the model
def _glm(**cfg):
    from glm52_model import GLM52Config, GLM52ForCausalLM

    torch.manual_seed(0)
    return GLM52ForCausalLM(GLM52Config.tiny(**cfg))


@pytest.mark.slow
def test_glm_tiny_runs_no_discrete_op_in_backward_with_no_selectors():
    from glm52_model.compile import apply_compile

    model = _glm()
    apply_compile(model, sacpass.backend(inner="aot_eager"))
    ids = torch.randint(0, model.cfg.vocab_size, (1, 32))
    with OpCounter(*DISCRETE) as calls:
        model(ids, labels=ids).backward()
    assert calls.backward == 0, calls.counts
    assert calls.count("forward", "aten::topk") >= 3  # the routers of the two MoE layers and of the MTP layer


@pytest.mark.slow
def test_interleaved_microbatches_use_their_own_forwards_ids():
    """F1 F2 B1 B2 through shared-top-k layers and MTP: each backward uses its own forward's IDs (saved per
    autograd graph), so the gradients equal those of running the microbatches one after the other."""
    from glm52_model.compile import apply_compile

    base = _glm()
    mbs = [torch.randint(0, base.cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(s))
           for s in (1, 2)]
    grads = {}
    for order in ("sequential", "interleaved"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        apply_compile(model, sacpass.backend(inner="aot_eager"))
        with OpCounter(*DISCRETE) as calls:
            if order == "sequential":
                for ids in mbs:
                    model(ids, labels=ids).backward()
            else:
                l1 = model(mbs[0], labels=mbs[0])
                l2 = model(mbs[1], labels=mbs[1])
                l1.backward()
                l2.backward()
        assert calls.backward == 0, calls.counts
        grads[order] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sequential"].keys() == grads["interleaved"].keys()
    for n in grads["sequential"]:
        torch.testing.assert_close(grads["interleaved"][n], grads["sequential"][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_transformers_glm5_dsa_layer_keeps_its_topk_with_no_selectors():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no GLM-5 DSA model")
    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
        num_experts_per_tok=2, index_topk=8, index_head_dim=32, index_n_heads=2, head_dim=8, first_k_dense_replace=1,
        use_cache=False)
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 32))
    with OpCounter(*DISCRETE) as eager:
        ref(ids, labels=ids).loss.backward()
    assert eager.count("backward", "aten::topk") > 0  # eager checkpointing replays the indexer and the router
    be = sacpass.backend(inner="aot_eager")
    with OpCounter(*DISCRETE) as calls:
        torch.compile(model, backend=be)(ids, labels=ids).loss.backward()
    assert calls.backward == 0, calls.counts
    kept = [s for r in be.reports for s in r.saved if s.reason == "discrete"]
    assert any(s.op == "aten::topk.default" and s.shape[-1] == "8" for s in kept)  # the indexer's top-k
    g_ref = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, g_ref[n].grad, rtol=1e-4, atol=1e-5, msg=n)
