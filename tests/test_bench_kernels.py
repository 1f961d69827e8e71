"""The kernel benchmark's pinned kernels (benchmarks/bench_kernels.py): each earlier session's tunables name every
tunable of today's op, so that a sweep merging them into today's (``SELECT_TUNABLES | pinned``) times what ran
then, not today's value of a key the pin left out."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_pinned_kernels_name_every_tunable():
    pytest.importorskip("tilelang", reason="TileLang not installed (pip install '.[cuda]')")
    import bench_kernels as bk
    from glm52_model.ops.cuda import dsa_topk_tl as tl
    pinned = {"PREVIOUS_LOGITS": (bk.PREVIOUS_LOGITS, tl.LOGITS_TUNABLES),
              "SIXTH_SESSION_LOGITS": (bk.SIXTH_SESSION_LOGITS, tl.LOGITS_TUNABLES),
              "FIFTH_SESSION_LOGITS": (bk.FIFTH_SESSION_LOGITS, tl.LOGITS_TUNABLES),
              "PREVIOUS_SELECT": (bk.PREVIOUS_SELECT, tl.SELECT_TUNABLES),
              "SIXTH_SESSION_SELECT": (bk.SIXTH_SESSION_SELECT, tl.SELECT_TUNABLES),
              "FIFTH_SESSION_SELECT": (bk.FIFTH_SESSION_SELECT, tl.SELECT_TUNABLES),
              "FOURTH_SESSION_SELECT": (bk.FOURTH_SESSION_SELECT, tl.SELECT_TUNABLES),
              "PREVIOUS_LAUNCH": (bk.PREVIOUS_LAUNCH, tl.LAUNCH_TUNABLES)}
    for name, (pin, today) in pinned.items():
        missing = sorted(set(today) - set(pin))
        assert not missing, f"bench_kernels.{name} leaves out {missing}: a sweep would time today's values there"
    start = bk.OP_SWEEP["session_start"]
    assert tl.SELECT_TUNABLES | start["select"] == bk.PREVIOUS_SELECT
    assert tl.LOGITS_TUNABLES | start["logits"] == bk.PREVIOUS_LOGITS
