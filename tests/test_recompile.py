"""Compile caches and recompiles: what enters the cache key, two processes sharing one cache directory,
dynamic sequence lengths, and a policy that cannot be hashed (extends tests/test_cache.py)."""
import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import sacpass
from sacpass.testing import OpCounter
from tests.support.fuzz_ops import D, FuzzModel, Program
from tests.support.toy import TOY_TOPK_OPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPK = "sacpass_toy::topk_ids"
backend_mod = importlib.import_module("sacpass._version")  # the module whose PASS_VERSION keys the sources
PROGRAM = Program(("nograd_ids", "sin"), ((0, 2),))  # a custom top-k under no_grad, then a pointwise op


def compile_step(save=None, recompute=None, length=8, inner="inductor", strict=True, **compile_kw):
    """A fresh backend, one compiled forward + backward; returns (backend, top-k runs in backward)."""
    torch._dynamo.reset()
    be = sacpass.backend(save=save, recompute=recompute, inner=inner, strict=strict, use_registered=False, save_discrete=False)
    model = torch.compile(FuzzModel(PROGRAM), backend=be, fullgraph=True, **compile_kw)
    out = model(torch.randn(length, D, requires_grad=True))
    with OpCounter(*TOY_TOPK_OPS) as topk:
        out.sum().backward()
    return be, topk.total


def aot_counts():
    return {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}


# ------------------------------------------------------------------------------------------ cache keys
def test_every_policy_knob_enters_the_cache_key(monkeypatch):
    """The backend's uuid (the key Inductor and AOTAutograd cache under) changes with every knob that
    changes what is saved, and only with those: equivalent spellings of one policy share it."""
    def uuid(**kw):
        return sacpass.backend(use_registered=False, save_discrete=False, **kw).uuid

    base = uuid(save=[TOPK])
    same = [uuid(save=[torch.ops.sacpass_toy.topk_ids]), uuid(save=["sacpass_toy.topk_ids", TOPK]),
            uuid(save=[TOPK], inner="aot_eager")]  # inner is not part of the partition
    assert set(same) == {base}
    changed = [uuid(save=[TOPK + ".default"]), uuid(save=[TOPK], strict=False),
               uuid(save=[TOPK], recompute=["aten::sin"]), uuid(save=["indexer::" + TOPK]), uuid()]
    with monkeypatch.context() as m:  # a new pass version must not reuse artifacts of the old one
        m.setattr(backend_mod, "PASS_VERSION", backend_mod.PASS_VERSION + 1)
        changed.append(uuid(save=[TOPK]))
    assert base not in changed and len(set(changed)) == len(changed), changed


_CHILD = textwrap.dedent("""
    import json
    import torch
    from torch._dynamo.utils import counters
    from torch._functorch import config as fc
    from torch._inductor import config as ic
    import sacpass
    from sacpass.testing import OpCounter
    from tests.support.fuzz_ops import D, FuzzModel, Program
    from tests.support.toy import TOY_TOPK_OPS
    with ic.patch(fx_graph_cache=True, fx_graph_remote_cache=False), fc.patch(enable_autograd_cache=True):
        # the packet spelling of "sacpass_toy::topk_ids" (the parent's): the same policy, the same key
        be = sacpass.backend(save=[torch.ops.sacpass_toy.topk_ids], use_registered=False, save_discrete=False)
        model = torch.compile(FuzzModel(Program(("nograd_ids", "sin"), ((0, 2),))), backend=be, fullgraph=True)
        out = model(torch.randn(8, D, requires_grad=True))
        with OpCounter(*TOY_TOPK_OPS) as topk:
            out.sum().backward()
    rep = be.reports[0]
    print(json.dumps({"aot": dict(counters["aot_autograd"]), "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
                      "uuid": be.uuid, "from_cache": rep.from_cache, "report": json.loads(rep.to_json()),
                      "backward_topk_runs": topk.total}))
""")


def _child(cache_dir) -> dict:
    """One compiled step of the toy program in a fresh Python process on ``cache_dir``: what it counted."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("SACPASS_DUMP_DIR", None)
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_hits_the_shared_cache(tmp_path):
    """A first process compiles cold; a second with the same TORCHINDUCTOR_CACHE_DIR hits both caches (no
    partition runs there) and still gets the report, marked from_cache. Both are fresh processes: what earlier
    tests left in this one (torch's configs and flags enter the AOTAutograd key) cannot decide the hit. The
    key sacpass gives the policy is the same here as there."""
    cold = _child(tmp_path / "inductor_cache")
    assert cold["aot"].get("autograd_cache_saved") == 1 and cold["backward_topk_runs"] == 0, cold
    assert not cold["from_cache"]
    warm = _child(tmp_path / "inductor_cache")
    assert warm["aot"].get("autograd_cache_hit") == 1 and warm["fxgraph_hit"] >= 1, warm
    assert warm["from_cache"] and warm["backward_topk_runs"] == 0
    assert warm["report"] == cold["report"]
    assert [s["op"] for s in warm["report"]["saved"] if s["reason"] == "must-save"] == [TOPK + ".default"]
    here = sacpass.backend(save=[TOPK], use_registered=False, save_discrete=False).uuid
    assert here == cold["uuid"] == warm["uuid"], (here, cold["uuid"], warm["uuid"])


# ------------------------------------------------------------------------------------------ dynamic shapes
@pytest.mark.parametrize("how", ["mark_dynamic", "automatic"])
def test_dynamic_lengths(how):
    """mark_dynamic: one compile serves every length; automatic dynamic: one static + one dynamic compile."""
    be = sacpass.backend(save=[TOPK], inner="aot_eager", use_registered=False, save_discrete=False)
    model = torch.compile(FuzzModel(PROGRAM), backend=be, fullgraph=True)
    counters.clear()
    for length in (8, 12, 16, 20, 28):
        x = torch.randn(length, D, requires_grad=True)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 0)
        out = model(x)
        with OpCounter(*TOY_TOPK_OPS) as topk:
            out.sum().backward()
        assert topk.total == 0, f"length {length}: the top-k ran again in backward"
    assert counters["stats"]["unique_graphs"] == len(be.reports) == (1 if how == "mark_dynamic" else 2)
    row = [s for s in be.reports[-1].saved if s.reason == "must-save"]
    assert [s.op for s in row] == [TOPK + ".default"] and not row[0].shape[0].isdigit(), row


# ------------------------------------------------------------------------------------------ unhashable policy
@pytest.mark.slow
def test_lambda_policy_bypasses_both_caches(fresh_cache):
    """A lambda selector has no stable key: a warning, and both caches really bypass (twice, no hit)."""
    for attempt in range(2):
        counters.clear()
        with pytest.warns(sacpass.SacpassWarning, match="caches are bypassed.*cache_hash"):
            be = sacpass.backend(save=[lambda n: "topk_ids" in n.name], use_registered=False, save_discrete=False)
        model = torch.compile(FuzzModel(PROGRAM), backend=be, fullgraph=True)
        out = model(torch.randn(8, D, requires_grad=True))
        with OpCounter(*TOY_TOPK_OPS) as topk:
            out.sum().backward()
        assert topk.total == 0, "the policy still applies without caching"
        aot = aot_counts()
        assert aot.get("autograd_cache_bypass", 0) >= 1 and "autograd_cache_hit" not in aot, (attempt, aot)
        assert "autograd_cache_saved" not in aot, aot
        assert counters["inductor"]["fxgraph_cache_bypass"] >= 1 and not counters["inductor"]["fxgraph_cache_hit"]
        assert not be.reports[0].from_cache
        torch._dynamo.reset()
    assert not os.path.exists(os.path.join(str(fresh_cache), "sacpass_reports")), "nothing persisted"

    select = lambda n: "topk_ids" in n.name  # noqa: E731 - the documented fix: a cache_hash
    select.cache_hash = "topk-ids-by-name-v1"
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sacpass.SacpassWarning)
        be = sacpass.backend(save=[select], use_registered=False, save_discrete=False)
    model = torch.compile(FuzzModel(PROGRAM), backend=be, fullgraph=True)
    model(torch.randn(8, D, requires_grad=True)).sum().backward()
    assert aot_counts().get("autograd_cache_saved") == 1, aot_counts()
