"""What enters the cache keys: every input of a partition decision changes the key (so a warm cache gives the
new decision), or the caches are bypassed and the report says so; one report per partitioned graph."""
import sys
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sacpass
from sacpass import policies
from sacpass.report_store import artifact_key, report_dir
from sacpass.selectors import PREDICATE_KEY_DEPTH, predicate_key
from sacpass.testing import OpCounter
from tests.support.toy import TOY_TOPK_OPS, ToyLayer

MM = torch.ops.aten.mm.default
SAVE_MM = True  # read by the predicates below
PICKED: list = ["mm"]  # a mutable global: no stable key
THIS = sys.modules[__name__]


def save_mm(node):
    return SAVE_MM and node.target is MM


def picked(node):
    return node.name in PICKED


def calls_save_mm(node):
    return save_mm(node)


class Chain(torch.nn.Module):
    """Two matmuls in a checkpoint: the first's output is recomputed unless a policy saves it. Inductor
    compiles it to extern calls only (no C++ kernels), so a compile takes about a second."""

    def __init__(self, detach=False):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
        self.detach = detach

    def body(self, x):
        return torch.mm(torch.mm(x, self.w1), self.w2)

    def forward(self, x):
        out = checkpoint(self.body, x, use_reentrant=False)
        return out.detach() if self.detach else out


def run(be, model=None, grad=True):
    """A fresh Dynamo compile of ``model`` under ``be`` and one training step; the SacpassWarnings raised."""
    torch._dynamo.reset()
    model = model or Chain()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.set_grad_enabled(grad):
            out = torch.compile(model, backend=be, fullgraph=True)(torch.randn(4, 8, requires_grad=grad))
        if out.requires_grad:
            out.sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, sacpass.SacpassWarning)]


def must_saves(report):
    return sum(s.reason == "must-save" for s in report.saved)


def hits():
    from torch._dynamo.utils import counters
    return counters["aot_autograd"]["autograd_cache_hit"]


@pytest.fixture
def registry():
    saved = list(policies._REGISTRY)
    policies.clear_registry()
    yield
    policies._REGISTRY[:] = saved


# ------------------------------------------------------------------------------------------ predicates
def test_predicate_key_covers_what_it_reads(monkeypatch):
    base = predicate_key(save_mm)[0]
    assert base is not None and predicate_key(calls_save_mm)[0] is not None
    via_helper = predicate_key(calls_save_mm)[0]
    monkeypatch.setattr(THIS, "SAVE_MM", False)  # a global, read directly and through a called function
    assert predicate_key(save_mm)[0] not in (None, base)
    assert predicate_key(calls_save_mm)[0] not in (None, via_helper)

    def closure(limit):
        def pick(node, scale=2):
            return len(node.users) * scale > limit
        return pick
    assert predicate_key(closure(1))[0] is not None
    assert predicate_key(closure(1))[0] == predicate_key(closure(1))[0] != predicate_key(closure(2))[0]

    key, why = predicate_key(closure([1]))
    assert key is None and "closure variable 'limit'" in why
    key, why = predicate_key(picked)
    assert key is None and "global 'PICKED' (list)" in why
    assert predicate_key(lambda n: True)[0] is None

    class Hashed:
        cache_hash = "v1"
    monkeypatch.setattr(THIS, "PICKED", Hashed())  # an object with a cache_hash is keyed by it
    assert predicate_key(picked)[0] is not None


def test_predicate_key_depth_is_bounded(tmp_path, monkeypatch):
    n = PREDICATE_KEY_DEPTH + 2
    (tmp_path / "deep_predicates.py").write_text("def f0(node):\n    return True\n" + "".join(
        f"def f{i}(node):\n    return f{i - 1}(node)\n" for i in range(1, n)) + "def rec(node):\n    return rec(node)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import deep_predicates as mod
    assert predicate_key(getattr(mod, f"f{n - 2}"))[0] is not None and predicate_key(mod.rec)[0] is not None
    key, why = predicate_key(getattr(mod, f"f{n - 1}"))
    assert key is None and f"more than {PREDICATE_KEY_DEPTH} functions" in why
    exec("def no_file(node):\n    return True", scope := {})
    assert "no source file" in predicate_key(scope["no_file"])[1]


def test_a_changed_global_changes_the_partition_with_warm_caches(fresh_cache, monkeypatch):
    be = sacpass.backend(save=[save_mm], use_registered=False, save_discrete=False)
    run(be)
    assert must_saves(be.reports[-1]) == 1
    monkeypatch.setattr(THIS, "SAVE_MM", False)  # after the backend was built and compiled
    assert not run(be) and must_saves(be.reports[-1]) == 0 and not be.reports[-1].from_cache
    monkeypatch.setattr(THIS, "SAVE_MM", True)
    before = hits()
    run(sacpass.backend(save=[save_mm], use_registered=False, save_discrete=False))
    assert hits() == before + 1


def test_an_unkeyable_global_bypasses_the_caches_and_says_so(fresh_cache):
    from torch._dynamo.utils import counters
    be = sacpass.backend(save=[picked], use_registered=False, save_discrete=False, strict=False)
    warned = run(be)
    assert any("bypassed" in w and "predicate:picked" in w and "'PICKED'" in w and "cache_hash" in w
               for w in warned), warned
    assert counters["aot_autograd"]["autograd_cache_bypass"] >= 1
    (report,) = be.reports
    assert any("compile caches bypassed" in w and "'PICKED'" in w for w in report.warnings), report.warnings


# ------------------------------------------------------------------------------------------ the registry
def test_registry_is_read_at_each_compile(fresh_cache, registry):
    be = sacpass.named_backend({"save_discrete": False})
    run(be)
    assert must_saves(be.reports[-1]) == 0
    with pytest.warns(sacpass.SacpassWarning, match=r"register_must_save\(aten::mm.default\).*keep their old "
                                                    r"policy.*torch._dynamo.reset\(\)"):
        sacpass.register_must_save(MM)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once warned, no graph was compiled since: no second warning
        sacpass.register_must_save("aten::addmm")
    run(be)  # the same backend, warm caches: the key follows the registry
    assert must_saves(be.reports[-1]) == 1 and not be.reports[-1].from_cache


def test_backends_keep_the_newest_reports_and_results():
    be = sacpass.backend(save=["aten::mm"], inner="aot_eager", use_registered=False, save_discrete=False)
    be.max_reports, be.max_results = 2, 1
    for _ in range(3):
        run(be)
    assert [r.graph for r in be.reports] == ["g1", "g2"] and len(be.results) == 1
    assert be.results[0].report is be.reports[-1]
    be.clear()
    assert be.reports == [] and be.results == []


# ------------------------------------------------------------------------------------------ every input
def _uuid(**kw):
    return sacpass.backend(use_registered=False, save_discrete=False, **kw).uuid


def test_every_config_input_changes_the_key(monkeypatch, registry):
    plan = sacpass.Plan()
    base = {"memory_budget": None, "plan": plan}
    keys = {"base": _uuid(**base)}
    for name, kw in {"memory_budget": {"memory_budget": 0.5}, "strict": {"strict": False},
                     "gpu_bytes": {"plan": sacpass.Plan(gpu_bytes=1)}, "host_bytes": {"plan": sacpass.Plan(host_bytes=1)},
                     "layers": {"plan": sacpass.Plan(layers=2)}, "hide": {"plan": sacpass.Plan(hide=0.5)},
                     "min_offload_bytes": {"plan": sacpass.Plan(min_offload_bytes=1)},
                     "cost": {"plan": sacpass.Plan(cost=sacpass.CostModel(efficiency=0.5))}}.items():
        keys[name] = _uuid(**{**base, **kw})
    keys["save_collectives"] = sacpass.backend(use_registered=False, save_discrete=False, save_collectives=False,
                                               plan=plan).uuid
    keys["save_discrete"] = sacpass.backend(use_registered=False, plan=plan).uuid
    be = sacpass.backend(save_discrete=False, plan=plan)  # use_registered: the registry is read live
    sacpass.register_must_save(MM)
    keys["registry"] = be.uuid
    with monkeypatch.context() as m:
        m.setattr(sacpass.plan.Plan, "host_budget", lambda self: 12345)  # host_bytes=None: this host's RAM
        keys["resolved host budget"] = _uuid(**base)
    with monkeypatch.context() as m:
        m.setattr(sys.modules["sacpass._version"], "PASS_VERSION", -1)
        keys["sacpass sources"] = _uuid(**base)
    assert len(set(keys.values())) == len(keys), keys


def _graph_and_inputs():
    gm = torch.fx.symbolic_trace(lambda x: x.sin())
    return gm, [torch.randn(4, 4, requires_grad=True)]


def test_every_graph_input_changes_the_report_key(monkeypatch):
    from torch._functorch import config as fc
    gm, inputs = _graph_and_inputs()
    be, x = sacpass.backend(use_registered=False), inputs[0]

    def key(gm=gm, x=x, be=be, uuid="u"):
        return artifact_key(gm, [x], uuid, be.inner)

    keys = {"base": key(), "uuid": key(uuid="v"), "inner": key(be=sacpass.backend(inner="aot_eager")),
            "graph": key(gm=torch.fx.symbolic_trace(lambda x: x.cos())),
            "shape": key(x=torch.randn(4, 5, requires_grad=True)), "dtype": key(x=x.double()),
            "strides": key(x=torch.randn(4, 4).t().requires_grad_()), "device": key(x=torch.empty(4, 4, device="meta",
                                                                                          requires_grad=True)),
            "requires_grad": key(x=x.detach())}
    with torch.no_grad():
        keys["grad mode"] = key()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys["autocast"] = key()
    with fc.patch(activation_memory_budget=0.5):
        keys["activation_memory_budget"] = key()
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0")
        keys["torch version"] = key()
    assert len(set(keys.values())) == len(keys), keys
    assert key(uuid=None) is None  # no uuid: the caches are bypassed and nothing is persisted


@pytest.mark.parametrize("change", ["resolved host budget", "memory_budget"])
def test_a_changed_input_is_a_new_decision_with_warm_caches(fresh_cache, monkeypatch, change):
    """Plan(host_bytes=None) offloads under this host's memory: a host with none must not get the offloads
    back from the cache; a smaller memory_budget must not get the larger one's saves back. (The key-level
    tests above cover every input; a changed key is an AOTAutograd miss by construction, since the uuid is
    in its key.)"""
    kw = {"plan": sacpass.Plan(min_offload_bytes=0)} if change != "memory_budget" else {"memory_budget": 1.0}
    first = sacpass.backend(use_registered=False, save_discrete=False, **kw)
    run(first)
    if change == "memory_budget":
        kw = {"memory_budget": 0.0}
    else:
        monkeypatch.setattr(sacpass.plan.Plan, "host_budget", lambda self: 0)
    be = sacpass.backend(use_registered=False, save_discrete=False, **kw)
    before = hits()
    run(be)
    assert hits() == before and not be.reports[0].from_cache
    reasons = [sorted(s.reason for s in b.reports[0].saved) for b in (first, be)]
    assert reasons[0] != reasons[1], reasons


# ------------------------------------------------------------------------------------------ one report each
@pytest.mark.parametrize("caches", ["cold", "warm", "disabled"])
def test_one_report_per_training_graph(fresh_cache, caches):
    from torch._functorch import config as fc
    from torch._inductor import config as ic

    def backend():
        return sacpass.backend(save=["aten::mm"], use_registered=False, save_discrete=False)
    if caches == "warm":
        run(backend())
    with ic.patch(fx_graph_cache=caches != "disabled"), fc.patch(enable_autograd_cache=caches != "disabled"):
        be = backend()
        assert run(be) == []
    (report,) = be.reports
    assert report.from_cache == (caches == "warm") and must_saves(report) == 1


@pytest.mark.parametrize("warm", [False, True])
def test_no_report_and_no_warning_without_a_partition(fresh_cache, warm):
    """An inference compile (grad off, or no output needing a gradient) has no partition: no report, and no
    warning, cold or warm."""
    be = sacpass.backend(use_registered=False, save_discrete=False)
    for _ in range(1 + warm):
        assert run(be, grad=False) == [] and run(be, Chain(detach=True)) == []
    assert be.reports == []


def test_a_warm_hit_without_a_persisted_report_says_so(fresh_cache):
    import shutil
    run(sacpass.backend(use_registered=False, save_discrete=False))
    shutil.rmtree(report_dir())
    be = sacpass.backend(use_registered=False, save_discrete=False)
    warned = run(be)
    assert be.reports == [] and any("no sacpass report was persisted" in w for w in warned), warned


def test_lambda_predicate_bypasses_cache_explicitly():
    with pytest.warns(sacpass.SacpassWarning, match="caches are bypassed"):
        be = sacpass.backend(save=[lambda n: n.name == "topk_ids"], inner="aot_eager", use_registered=False,
                             save_discrete=False)
    assert be.uuid is None

    def named(node):
        return node.name == "topk_ids"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be = sacpass.backend(save=[named], inner="aot_eager", use_registered=False, save_discrete=False)
    assert be.uuid is not None
    model = torch.compile(ToyLayer(), backend=be, fullgraph=True)
    out = model(torch.randn(8, 32, requires_grad=True))
    with OpCounter(*TOY_TOPK_OPS) as topk:
        out.sum().backward()
    assert topk.total == 0


def test_lambda_warning_points_at_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sacpass.backend(save=[lambda n: False])
    (w,) = [w for w in caught if "no stable cache key" in str(w.message)]
    assert w.filename == __file__
