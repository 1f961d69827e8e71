"""Property-based tests of the sacpass pass: generated programs, checkpoint regions and policies.

For every generated case (tests/support/fuzz_ops.py holds the vocabulary) the compiled model either
  * matches eager (outputs and gradients), runs no must-save op again during backward (counted at run
    time), saves exactly the bytes its report states (counted at run time with saved-tensor hooks, and
    summed from the backward graph's inputs), and never saves a must-recompute node; or
  * raises the documented SacpassError for what the policy asked (a conflict, a selected view, an
    unmatched selector in strict mode).

Profiles: SACPASS_HYPOTHESIS_PROFILE=ci (default: fixed seed, bounded examples) or =long (random seeds,
about ten times as many examples). See docs/reliability.md.
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config

import sacpass
import sacpass.offload as offload_runtime
from tests.support.fuzz_ops import (ABSENT_OPS, COUNTABLE, DISCRETE_OPS, RANDOM_STEPS, S, STEP_VIEWS, STEPS, D,
                                    FuzzModel, PacketCounter, Program, packet)
from tests.support.toy import grads_of

# ------------------------------------------------------------------------------------------ profiles
_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: the same examples on every run, failures reported as found (shrinking can take minutes);
# long: new examples on every run, failures shrunk to a minimal case to paste into @example
settings.register_profile("ci", derandomize=True, phases=(Phase.explicit, Phase.generate), **_COMMON)
settings.register_profile("long", derandomize=False, **_COMMON)
PROFILE = os.environ.get("SACPASS_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"SACPASS_HYPOTHESIS_PROFILE={PROFILE!r}: use 'ci' or 'long'.")

# examples per property and profile; keep docs/reliability.md in step
EXAMPLES = {
    "ci": {"aot_eager": 180, "offload": 40, "inductor": 2, "inductor_slow": 1},  # inductor_slow: skipped
    "long": {"aot_eager": 2000, "offload": 400, "inductor": 20, "inductor_slow": 100},
}[PROFILE]
MAX_STEPS = {"ci": 4, "long": 8}[PROFILE]


def fuzz_settings(kind: str) -> settings:
    return settings(settings.get_profile(PROFILE), max_examples=EXAMPLES[kind])


# ------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One generated test case; paste its repr into ``@example`` to pin a failure."""

    program: Program
    save: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    strict: bool = True
    seed: int = 0
    discrete: bool = False  # sacpass's default: discrete decisions (topk, the custom top-k ops) saved
    offload: tuple[str, ...] = ()
    plan: tuple[int, int] | None = None  # (gpu_bytes, host_bytes) of a sacpass.Plan, min_offload_bytes=0
    pytorch_budget: float = 1.0  # PyTorch's own torch._functorch.config.activation_memory_budget (its knapsack below 1)
    memory_budget: float | None = None  # sacpass.backend(memory_budget=): PyTorch's solver over the released regions


@st.composite
def regions(draw, n: int) -> tuple[tuple[int, int], ...]:
    kind = draw(st.sampled_from(["one", "none", "back_to_back", "nested"]))
    if kind == "none":
        return ()
    if kind == "one" or n < 2:
        a = draw(st.integers(0, n - 1))
        return ((a, draw(st.integers(a + 1, n))),)
    if kind == "back_to_back":
        a = draw(st.integers(0, n - 2))
        b = draw(st.integers(a + 1, n - 1))
        return ((a, b), (b, draw(st.integers(b + 1, n))))
    a = draw(st.integers(0, n - 2))  # nested: a <= b < c <= d, (b, c) != (a, d)
    d = draw(st.integers(a + 2, n))
    b = draw(st.integers(a, d - 1))
    c = draw(st.integers(b + 1, d if b > a else d - 1))
    return ((a, d), (b, c))


# An optional deliberate mistake in the policy; the first entry ("none") is what hypothesis shrinks to.
MISTAKES = ("none", "none", "none", "none", "none", "none", "conflict", "view", "absent_save", "absent_recompute")


@st.composite
def cases(draw, steps=tuple(sorted(STEPS)), ops_filter=None, max_steps: int = MAX_STEPS, mistakes=MISTAKES):
    names = draw(st.lists(st.sampled_from(steps), min_size=1, max_size=max_steps))
    program = Program(tuple(names), draw(regions(len(names))))
    pool = sorted(op for op in program.ops() if ops_filter is None or op in ops_filter)
    save = draw(st.lists(st.sampled_from(pool), max_size=2, unique=True))
    rest = [op for op in pool if op not in save]
    recompute = draw(st.lists(st.sampled_from(rest), max_size=1, unique=True)) if rest else []
    mistake = draw(st.sampled_from(mistakes))
    if mistake == "conflict":
        op = draw(st.sampled_from(pool))
        save, recompute = save + [op] * (op not in save), recompute + [op] * (op not in recompute)
    elif mistake == "view":
        views = sorted(v for s in program.steps for v in STEP_VIEWS.get(s, ()))
        if views:
            save = save + [draw(st.sampled_from(views))]
    elif mistake == "absent_save":
        save = save + [draw(st.sampled_from(ABSENT_OPS))]
    elif mistake == "absent_recompute":
        recompute = recompute + [draw(st.sampled_from(ABSENT_OPS))]
    return Case(program, tuple(save), tuple(recompute), draw(st.booleans()), draw(st.integers(0, 2 ** 16)),
                draw(st.booleans()), pytorch_budget=draw(st.sampled_from(PYTORCH_BUDGETS)))


# PyTorch's own memory budget under the policy: its default (1: no knapsack) most of the time
PYTORCH_BUDGETS = (1.0, 1.0, 1.0, 0.5, 0.05)


def expected_errors(case: Case) -> tuple[type, ...]:
    """The SacpassErrors the case must raise (any one of them), () when it must compile."""
    present = case.program.ops()
    views = {v for s in case.program.steps for v in STEP_VIEWS.get(s, ())}
    errors: list[type] = []
    lists = (case.save, case.recompute, case.offload)
    if any(set(a) & set(b) for i, a in enumerate(lists) for b in lists[i + 1:]):  # refused when built
        return (sacpass.PolicyConflictError,)
    if set(case.save + case.offload) & views:
        errors.append(sacpass.SelectorError)
    if errors:  # raised at the first offending node, before the unmatched check
        return tuple(errors)
    # an explicit selector must match in a graph that holds a checkpointed region (sacpass.passes.tag_policy)
    if case.strict and set(case.save + case.recompute + case.offload) - present - views:  # no graph of the compile holds it
        return (sacpass.UnmatchedSelectorError,)
    return ()


# ------------------------------------------------------------------------------------------ checking
def sacpass_error(exc: BaseException) -> sacpass.SacpassError | None:
    """Dynamo wraps backend errors (BackendCompilerFailed); find the SacpassError inside."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, sacpass.SacpassError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or getattr(exc, "inner_exception", None) or exc.__context__
    return None


def step(model, x, seed: int, hooks: bool = False):
    """Forward with a fixed RNG seed; returns (output, the input leaf, bytes autograd packed for backward)."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    packed: list[int] = []

    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t

    torch.manual_seed(seed)
    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
    else:
        out = model(x)
    return out, x, sum(packed)


def backward_graph_bytes(bw: torch.fx.GraphModule) -> int:
    """Sum of storage bytes of the backward graph's saved (non-tangent) tensor inputs, at size hints."""
    total = 0
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            numel = 1
            for s in val.shape:
                numel *= int(s) if isinstance(s, int) else int(s.node.hint)
            total += numel * val.element_size()
    return total


def check_case(case: Case, inner: str = "aot_eager") -> None:
    program = case.program
    ref = FuzzModel(program, seed=case.seed)
    x = torch.randn(S, D, generator=torch.Generator().manual_seed(case.seed + 1))
    out_e, x_e, _ = step(ref, x, case.seed)
    out_e.square().sum().backward()
    grads_e = grads_of(ref, x_e)

    torch._dynamo.reset()
    expected = expected_errors(case)
    with warnings.catch_warnings(record=True) as caught, \
            inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False, activation_memory_budget=case.pytorch_budget):
        # caches off: the partition must run for every case
        warnings.simplefilter("always")
        try:
            plan = None if case.plan is None else sacpass.Plan(gpu_bytes=case.plan[0], host_bytes=case.plan[1],
                                                               min_offload_bytes=0)
            be = sacpass.backend(save=list(case.save), recompute=list(case.recompute), offload=list(case.offload),
                                 plan=plan, memory_budget=case.memory_budget, inner=inner, strict=case.strict,
                                 use_registered=False,
                                 save_discrete=case.discrete)
            model = torch.compile(copy.deepcopy(ref), backend=be, fullgraph=True)
            out_c, x_c, packed = step(model, x, case.seed, hooks=True)
            if expected:  # selectors are checked for the whole compile when the backward starts
                out_c.square().sum().backward()
        except Exception as e:  # noqa: BLE001 - sorted out below
            err = sacpass_error(e)
            if err is None or not expected:
                raise
            assert isinstance(err, expected), f"expected one of {expected}, got {err!r}"
            return
    assert not expected, f"expected {expected} but the case compiled"
    assert len(be.reports) == 1 and len(be.results) == 1, "one graph per case (fullgraph=True)"
    report, result = be.reports[0], be.results[0]
    explicit = case.save + case.recompute + case.offload
    unmatched = sorted(set(explicit) - program.ops()) if program.regions else []
    assert sorted(report.unmatched) == unmatched

    # no must-save op runs again during backward (counted at run time), for ops whose backward never calls
    # them; under Inductor only ops it leaves as calls (custom ops, fallbacks) are seen, fused ones count 0
    kept = set(case.save + case.offload) | (DISCRETE_OPS & program.ops() - set(case.recompute) if case.discrete else set())
    counted = [op for op in kept if op in COUNTABLE and op in program.ops()]
    counter = PacketCounter([packet(op) for op in counted])
    absent = sorted(set(explicit) - program.ops())
    with warnings.catch_warnings(record=True) as caught_bw, counter if counted else contextlib.nullcontext():
        warnings.simplefilter("always")
        out_c.square().sum().backward()
    assert not any(counter.counts.values()), f"must-save ops ran in backward: {dict(counter.counts)}"
    if absent:  # strict=False (strict would have raised): the compile-level check warns once
        assert any("matched no forward node in any graph" in str(w.message) for w in caught_bw)

    # numerics equal eager
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    grads_c = grads_of(model, x_c)
    assert len(grads_c) == len(grads_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    # the partition: no must-save node in the backward graph; a must-recompute node saved only with a warning
    # (PyTorch saves a value one checkpoint region passes to the next, whatever its tag)
    final = {t["name"]: t for t in report.tagged}  # the last record of a node is its tag
    bw_calls = {n.name for n in result.backward.graph.nodes if n.op == "call_function"}
    bw_inputs = {n.name for n in result.backward.graph.nodes if n.op == "placeholder"}
    assert not report.violations, report.violations
    leaked = sorted(n for n, r in final.items() if r["tag"] == "MUST_SAVE" and n in bw_calls)
    assert not leaked, f"must-save nodes computed in backward: {leaked}"
    kept = [n for n, r in final.items() if r["tag"] == "MUST_RECOMPUTE" and n in bw_inputs
            and not r["selector"].startswith("derived from")]
    warned = " ".join(str(w.message) for w in caught if "saved for backward anyway" in str(w.message))
    assert all(f"{n} (" in warned for n in kept), f"must-recompute nodes saved without a warning: {kept}"

    # the report's bytes: sum of its rows == the backward graph's inputs == what autograd packed at run time
    assert report.total_bytes == sum(s.bytes for s in report.saved)
    assert report.total_bytes == backward_graph_bytes(result.backward)
    assert report.total_bytes == packed, (report.total_bytes, packed)

    # the offload runtime: what the step offloaded came back, and nothing of it outlives the step
    st = offload_runtime.stats()
    assert st.bundles_alive == 0 and st.host_bytes_alive == 0, st.format()


# ------------------------------------------------------------------------------------------ properties
P = Program


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@fuzz_settings("aot_eager")
@given(case=cases())
# regression and coverage examples: every region shape, every op family, each policy mistake
@example(case=Case(P(("nograd_ids", "mm"), ((0, 2),)), save=("sacpass_toy::topk_ids",)))
@example(case=Case(P(("pair", "dropout", "sin"), ((0, 1), (1, 3))), save=("sacpass_toy::topk_pair", "aten::sin")))
@example(case=Case(P(("pair", "dropout", "sin"), ((0, 1), (1, 3))), save=("sacpass_toy::topk_pair", "aten::sin"),
                   pytorch_budget=0.5))
@example(case=Case(P(("mm", "topk", "cast", "gelu"), ((0, 4), (1, 3))), save=("aten::topk",),
                   recompute=("aten::gelu",)))
@example(case=Case(P(("inplace", "rmsnorm", "amax"), ()), save=("aten::add", "aten::mean")))
@example(case=Case(P(("view", "mm"), ((0, 2),)), save=("aten::transpose",)))
@example(case=Case(P(("mm", "sin"), ((0, 2),)), save=("aten::mm",), recompute=("aten::mm",)))
@example(case=Case(P(("dropout", "mm"), ((0, 2),)), save=("aten::cumsum",), strict=False))
@example(case=Case(P(("dropout", "tanh"), ((0, 2),)), recompute=("aten::native_dropout",)))
# cases the fuzzer found: a must-recompute node one region hands to the next is saved (with a warning), and a
# selector matching a cast inside a custom op's backward formula leaves that backward node untagged
@example(case=Case(P(("cast", "dropout"), ((0, 1), (1, 2))), recompute=("aten::_to_copy",)))
@example(case=Case(P(("rmsnorm", "cast", "pair"), ((0, 3), (2, 3))), save=("aten::mean", "aten::_to_copy"),
                   recompute=("sacpass_toy::topk_pair",), seed=56306))
@example(case=Case(P(("mm", "topk", "argsort", "nograd_ids"), ((0, 4),)), discrete=True))
@example(case=Case(P(("maxdim", "topk"), ((0, 1), (1, 2))), recompute=("aten::topk",), discrete=True))
def test_fuzz_aot_eager(case):
    check_case(case, "aot_eager")


@st.composite
def offload_cases(draw):
    """A valid case with some ops offloaded, or a plan choosing save / offload / recompute under small budgets."""
    case = draw(cases(mistakes=("none",)))
    pool = sorted(case.program.ops() - set(case.save + case.recompute))
    offload = tuple(draw(st.lists(st.sampled_from(pool), max_size=2, unique=True))) if pool else ()
    plan = draw(st.none() | st.tuples(st.integers(0, 1 << 14), st.integers(0, 1 << 16)))
    return dataclasses.replace(case, offload=offload, plan=plan, memory_budget=draw(st.sampled_from(MEMORY_BUDGETS)))


MEMORY_BUDGETS = (None, None, 0.0, 0.3, 1.0)  # sacpass's own: none most of the time


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@fuzz_settings("offload")
@given(case=offload_cases())
@example(case=Case(P(("mm", "topk", "gelu"), ((0, 3),)), offload=("aten::mm",), plan=(0, 1 << 16)))
@example(case=Case(P(("pair", "mm"), ((0, 1), (1, 2))), offload=("sacpass_toy::topk_pair",), discrete=True))
@example(case=Case(P(("pair", "mm"), ((0, 1), (1, 2))), offload=("sacpass_toy::topk_pair",), discrete=True,
                   pytorch_budget=0.5))
@example(case=Case(P(("amax", "cast", "maxdim"), ()), save=("aten::_to_copy", "aten::amax"), offload=("aten::max",),
                   pytorch_budget=0.5))
def test_fuzz_offload_and_plan(case):
    check_case(case, "aot_eager")


# Inductor decomposes some ops (gelu -> erf, _to_copy -> convert_element_type) and draws its own random
# numbers, so its sample uses the ops that survive into its joint graph and no dropout.
INDUCTOR_OPS = frozenset({"aten::mm", "aten::sin", "aten::tanh", "aten::rsqrt", "aten::amax", "aten::topk",
                          "sacpass_toy::topk_pair", "sacpass_toy::topk_ids", "aten::index"})
INDUCTOR_STEPS = tuple(sorted(set(STEPS) - RANDOM_STEPS - {"gelu", "cast", "view", "inplace", "argsort", "maxdim"}))


def _inductor_cases(max_steps):
    return cases(steps=INDUCTOR_STEPS, ops_filter=INDUCTOR_OPS, max_steps=max_steps, mistakes=("none",))


# both custom top-k ops saved and aten.topk recomputed, in nested regions: the quick run's Inductor case
INDUCTOR_EXAMPLE = Case(P(("nograd_ids", "pair", "topk"), ((0, 3), (1, 2))),
                        save=("sacpass_toy::topk_ids", "sacpass_toy::topk_pair"), recompute=("aten::topk",))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fuzz_inductor_example():
    check_case(INDUCTOR_EXAMPLE, "inductor")


@pytest.mark.slow  # a C++ compile per generated case (the example above runs in the quick run)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@fuzz_settings("inductor")
@given(case=_inductor_cases(3))
def test_fuzz_inductor(case):
    check_case(case, "inductor")


@pytest.mark.slow
@pytest.mark.skipif(PROFILE != "long", reason="Inductor fuzzing beyond the CI sample: SACPASS_HYPOTHESIS_PROFILE=long")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@fuzz_settings("inductor_slow")
@given(case=_inductor_cases(MAX_STEPS))
def test_fuzz_inductor_extended(case):
    check_case(case, "inductor")
