"""Functional collectives inside a checkpoint: saved by default (PyTorch's rule outside checkpoints),
recomputed when a recompute selector says so. One-rank gloo group, real collectives."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import sacpass
from tests.support.toy import ToyLayer


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class GatheredKV(ToyLayer):
    """The toy layer whose key/value projection is all-gathered across ranks (sequence parallel)."""

    def body(self, x):
        ids = self.indexer(x)
        kv = fc.all_gather_tensor(self.wkv(x), 0, dist.group.WORLD)
        from tests.support.toy import sparse_attend
        h = x + self.wo(sparse_attend(self.wq(x), kv, ids))
        return h + self.mlp(h)


def _compile_step(**kw):
    be = sacpass.backend(inner="aot_eager", use_registered=False, save_discrete=False, save=["sacpass_toy::topk_ids"], **kw)
    model = torch.compile(GatheredKV(), backend=be, fullgraph=True)
    model(torch.randn(16, 32, requires_grad=True)).sum().backward()
    return be.reports[0]


def test_collective_saved_by_default(one_rank_group):
    report = _compile_step()
    saved = {s.op: s.reason for s in report.saved}
    assert saved.get("_c10d_functional::all_gather_into_tensor.default") == "must-save", report.format()
    assert "_c10d_functional::all_gather_into_tensor.default" not in report.recomputed


def test_collective_follows_recompute_selector(one_rank_group):
    report = _compile_step(recompute=["_c10d_functional::all_gather_into_tensor"])
    assert report.recomputed.get("_c10d_functional::all_gather_into_tensor.default") == 1, report.format()


def test_collective_recomputed_when_option_off(one_rank_group):
    report = _compile_step(save_collectives=False)  # PyTorch alone: the checkpoint tag wins, it is replayed
    assert report.recomputed.get("_c10d_functional::all_gather_into_tensor.default") == 1, report.format()
