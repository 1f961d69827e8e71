"""What the planner keeps within its budgets: the whole-value knapsack, and each value priced once.

The planner's inputs and reports are tests/test_frontier.py; the model plan's run time tests/test_model_plan.py.
"""
from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass.passes.knapsack import best_subset
from sacpass.testing import no_compile_caches
from tests.support.toy import assert_close_lists, grads_of


# --------------------------------------------------------------------------------------------- the search
def _brute_force(values, weights, capacities):
    n, dims = len(values), len(capacities)
    return max((sum(values[i] for i in s) for r in range(n + 1) for s in itertools.combinations(range(n), r)
                if all(sum(weights[i][k] for i in s) <= capacities[k] for k in range(dims))), default=0.0)


def _fits(chosen, weights, capacities):
    return all(sum(weights[i][k] for i in chosen) <= capacities[k] for k in range(len(capacities)))


def test_the_search_finds_the_best_subset_of_every_small_instance():
    rng = random.Random(0)
    for _ in range(300):
        n, dims = rng.randint(0, 11), rng.randint(1, 2)
        values = [rng.random() * 10 for _ in range(n)]
        weights = [tuple(rng.randint(0, 50) for _ in range(dims)) for _ in range(n)]
        capacities = tuple(rng.randint(0, 120) for _ in range(dims))
        chosen = best_subset(values, weights, capacities)
        assert _fits(chosen, weights, capacities) and chosen == sorted(set(chosen))
        assert sum(values[i] for i in chosen) == pytest.approx(_brute_force(values, weights, capacities))


def test_one_large_value_beats_denser_small_ones_that_leave_the_share_unused():
    """A decoder layer's share on one H200 at 64K tokens (MB, ms by the cost model): the attention output (4312,
    48.9) or a dozen projections' inputs, each a little denser. Densest first takes the projections (40.7 ms)
    and leaves the attention output out; the search keeps it and fills the rest (62.6 ms)."""
    ms = [48.9, 2.51, 3.27, 2.72, 9.86, 4.72, 3.93, 9.45, 0.43, 1.27, 1.27, 1.27, 25.8, 3.66, 1.7]
    mb = [4312, 2, 138, 138, 805, 415, 415, 1107, 84, 268, 268, 268, 4295, 2147, 4295]
    densest_first, left = [], 5170
    for i in sorted(range(len(ms)), key=lambda i: -ms[i] / mb[i]):
        if mb[i] <= left:
            densest_first.append(i)
            left -= mb[i]
    assert 0 not in densest_first and sum(ms[i] for i in densest_first) == pytest.approx(40.7)
    chosen = best_subset(ms, [(m,) for m in mb], (5170,))
    assert 0 in chosen and sum(ms[i] for i in chosen) == pytest.approx(62.55)


def test_a_search_cut_short_is_never_worse_than_densest_first_and_leaves_no_item_that_fits():
    rng = random.Random(1)
    values = [rng.random() for _ in range(60)] + [0.0, 0.0]  # items of no value are filled in too
    weights = [(rng.randint(1, 100), rng.randint(1, 100)) for _ in range(60)] + [(1, 1), (0, 0)]
    capacities = (900, 1100)
    full, cut = best_subset(values, weights, capacities), best_subset(values, weights, capacities, max_work=1)
    for chosen in (full, cut):
        assert _fits(chosen, weights, capacities)
        left = [capacities[k] - sum(weights[i][k] for i in chosen) for k in range(2)]
        assert not [i for i in range(len(values)) if i not in chosen and all(weights[i][k] <= left[k] for k in range(2))]
    assert sum(values[i] for i in full) >= sum(values[i] for i in cut)
    assert best_subset([1.0, 2.0], [(5,), (6,)], (0,)) == [] and best_subset([], [], (3,)) == []


# ------------------------------------------------------------------------------------- in the planner
class OneLargeManySmall(nn.Module):
    """A checkpointed region whose backward reads one large product (x @ wide: 32 deep, 256 wide) and six small
    ones (40 deep, 32 wide): per byte the small ones cost more to recompute, together less than the large."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Parameter(torch.randn(32, 256) * 0.1)
        self.narrow = nn.ParameterList(nn.Parameter(torch.randn(40, 32) * 0.1) for _ in range(6))

    def body(self, x):
        deep = torch.cat([x, x[:, :8]], dim=1)  # [N, 40], recomputed from the input for free
        out = torch.sin(x @ self.wide).sum(-1, keepdim=True)
        for w in self.narrow:
            out = out + torch.sin(deep @ w).sum(-1, keepdim=True)
        return out

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def test_the_planner_keeps_the_value_that_holds_more_recompute_time_and_matches_eager():
    torch.manual_seed(0)
    model, x = OneLargeManySmall(), torch.randn(64, 32)
    large = 64 * 256 * 4
    flops_only = sacpass.CostModel(memory_bytes_per_s=1e30, launch_s=0.0, copy_bytes_per_s=1e30)  # no copy window
    plan = sacpass.Plan(host_bytes=large + 4096, min_offload_bytes=0, cost=flops_only)
    be = sacpass.backend(inner="aot_eager", plan=plan)
    compiled = torch.compile(copy.deepcopy(model), backend=be, fullgraph=True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with no_compile_caches():
        compiled(xs[0]).square().sum().backward()
    model(xs[1]).square().sum().backward()
    assert_close_lists(grads_of(compiled, xs[0]), grads_of(model, xs[1]), rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    mms = [d for d in rep.decisions if d.op == "aten::mm.default"]
    assert len(mms) == 7, rep.format(verbose=True)
    big = next(d for d in mms if d.bytes == large)
    small = [d for d in mms if d is not big]
    assert max(d.recompute_ms / d.bytes for d in small) > big.recompute_ms / big.bytes  # the small ones are denser
    assert big.action == "offload" and {d.action for d in small} == {"recompute"}, rep.format(verbose=True)
    assert big.recompute_ms > sum(d.recompute_ms for d in small)
    assert all(d.bound == "host budget" for d in small)


def test_a_larger_host_budget_never_leaves_more_recompute_time_by_the_cost_model():
    """By its own cost model the plan never gets slower with more budget: the recompute time it leaves only
    falls as the host budget grows, down to none once every value fits."""
    torch.manual_seed(0)
    model, x = OneLargeManySmall(), torch.randn(64, 32)
    flops_only = sacpass.CostModel(memory_bytes_per_s=1e30, launch_s=0.0, copy_bytes_per_s=1e30)
    left = []
    for host in range(0, 64 * 256 * 4 + 6 * 64 * 32 * 4 + 8192, 4096):
        torch._dynamo.reset()
        be = sacpass.backend(inner="aot_eager", plan=sacpass.Plan(host_bytes=host, min_offload_bytes=0, cost=flops_only))
        with no_compile_caches():
            torch.compile(copy.deepcopy(model), backend=be, fullgraph=True)(x.clone().requires_grad_(True)).sum().backward()
        (rep,) = be.reports
        left.append(sum(d.recompute_ms for d in rep.decisions if d.action == "recompute"))
    assert left[0] > 0 and left[-1] == 0, left
    assert all(b <= a + 1e-12 for a, b in zip(left, left[1:])), left


class SharedProjection(nn.Module):
    """Two branches of one checkpointed region read the same projection of the same input (as a query's and a
    key's linear quantise one input): one value after the partition's common-subexpression elimination."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64) * 0.1)
        self.v = nn.Parameter(torch.randn(32, 64) * 0.1)

    def body(self, x):
        return torch.sin(x @ self.w) + torch.cos(x @ self.w) * torch.tanh(x @ self.v)

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def test_a_value_computed_twice_is_priced_once_so_the_budget_holds_what_the_partition_keeps():
    """The budget holds exactly the two distinct products. Priced twice, the shared one would take two
    products' bytes and leave the other product to recompute."""
    torch.manual_seed(0)
    model, x = SharedProjection(), torch.randn(16, 32)
    product = 16 * 64 * 4
    plan = sacpass.Plan(host_bytes=2 * product, min_offload_bytes=0, cost=sacpass.CostModel(copy_bytes_per_s=1e30))
    be = sacpass.backend(inner="aot_eager", plan=plan)
    compiled = torch.compile(copy.deepcopy(model), backend=be, fullgraph=True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with no_compile_caches():
        compiled(xs[0]).sum().backward()
    model(xs[1]).sum().backward()
    assert_close_lists(grads_of(compiled, xs[0]), grads_of(model, xs[1]), rtol=1e-4, atol=1e-5)
    (rep,) = be.reports
    mms = [d for d in rep.decisions if d.op == "aten::mm.default"]
    assert len(mms) == 2 and {d.action for d in mms} == {"offload"}, rep.format(verbose=True)
    assert rep.host_bytes == 2 * product


@pytest.mark.slow  # the GLM tiny model compiles twice
def test_the_glm_layer_s_shared_quantisations_are_planned_once():
    """The query's and the key-value's down projections quantise one normed input (so do the shared experts'
    gate and up projections): one planned value each, none that the partition leaves unused."""
    from glm52_model import GLM52Config, GLM52ForCausalLM
    from glm52_model.compile import apply_compile

    torch.manual_seed(0)
    eager = GLM52ForCausalLM(GLM52Config.tiny(num_layers=2, mtp_layers=0, fp8=True))
    ids = torch.randint(0, eager.cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    plan = sacpass.ModelPlan(layers=2, gpu_bytes=0, host_bytes=1 << 24, min_offload_bytes=0, cost=sacpass.CostModel())
    with no_compile_caches():
        be = sacpass.backend(inner="aot_eager", plan=plan)
        model = apply_compile(copy.deepcopy(eager), backend=be, fullgraph=True)
        model(ids).float().sum().backward()
    planned = [d for r in be.reports for d in r.decisions if d.op != "input"]
    quantised = [d for d in planned if d.op == "glm52::fp8_quantize_pair.default"]
    assert quantised and not [d for d in planned if d.action == "unneeded"], [(d.name, d.module) for d in planned]
    modules = {d.module for d in quantised}
    assert "attn.wq_a" in modules and "attn.wkv_a" not in modules, modules
