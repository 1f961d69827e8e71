"""The kernel benchmark's sweeps (benchmarks/bench_kernels.py) name only tunables the op's kernels take, each entry
times something other than the op's default, and an unknown --op-configs name is refused before any GPU work."""
import inspect

import pytest


@pytest.fixture(scope="module")
def modules():
    pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")
    import bench_kernels as bk  # benchmarks/ (pytest.ini's pythonpath)
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    return bk, tl


def _params(fn):
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY}


def test_sweeps_name_only_the_kernels_tunables(modules):
    bk, tl = modules
    assert set(tl.LOGITS_TUNABLES) <= _params(tl.build_indexer_logits)
    assert set(tl.SELECT_TUNABLES) <= _params(tl.build_topk_select)
    for name, over in bk.LOGITS_SWEEP.items():
        assert set(over) <= set(tl.LOGITS_TUNABLES), f"LOGITS_SWEEP[{name!r}]: {sorted(set(over) - set(tl.LOGITS_TUNABLES))}"
    for name, over in bk.SELECT_SWEEP.items():
        assert set(over) <= set(tl.SELECT_TUNABLES), f"SELECT_SWEEP[{name!r}]: {sorted(set(over) - set(tl.SELECT_TUNABLES))}"
    for name, over in bk.OP_SWEEP.items():
        assert set(over) <= {"launch", "budget", "logits", "select"}, name
        assert set(over.get("launch", {})) <= set(tl.LAUNCH_TUNABLES), name
        assert set(over.get("logits", {})) <= set(tl.LOGITS_TUNABLES), name
        assert set(over.get("select", {})) <= set(tl.SELECT_TUNABLES), name


def test_sweep_entries_differ_from_the_default(modules):
    """Every entry but "default" changes something: one that merges into today's tunables unchanged would time
    the default twice under another name."""
    bk, tl = modules
    for sweep, today in ((bk.LOGITS_SWEEP, tl.LOGITS_TUNABLES), (bk.SELECT_SWEEP, tl.SELECT_TUNABLES)):
        assert sweep["default"] == {}
        for name, over in sweep.items():
            if name != "default":
                assert today | over != today, f"{name} is the default"
    for name, over in bk.OP_SWEEP.items():
        same = (tl.LAUNCH_TUNABLES | over.get("launch", {}) == tl.LAUNCH_TUNABLES
                and over.get("budget", tl.LOGITS_BUDGET_BYTES) == tl.LOGITS_BUDGET_BYTES
                and tl.LOGITS_TUNABLES | over.get("logits", {}) == tl.LOGITS_TUNABLES)
        assert not same, f"OP_SWEEP[{name!r}] is the op's default"


def test_select_sweep_entries_pass_the_select_builders_checks(modules):
    """Each select entry satisfies build_topk_select's constraints (threads dividing 4096, candidates >= 1.25 topk,
    vec dividing the launcher's padding), which otherwise fail only on the GPU machine, mid-run."""
    bk, tl = modules
    for name, over in bk.SELECT_SWEEP.items():
        t = tl.SELECT_TUNABLES | over
        assert tl.BLOCK_N % t["vec"] == 0, name
        assert t["threads"] & (t["threads"] - 1) == 0 and 4096 % t["threads"] == 0, name
        assert t["candidates"] >= 2048 + 2048 // 4, name


def test_unknown_op_config_is_refused(modules):
    bk, _ = modules
    with pytest.raises(SystemExit, match="not in OP_SWEEP"):
        bk.main(["--op-configs", "overlap,no_such_variant"])
