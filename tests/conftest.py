import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A private, empty Inductor/AOTAutograd cache dir with both caches on."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    from torch._functorch import config as fc
    from torch._inductor import config as ic
    with ic.patch(fx_graph_cache=True, fx_graph_remote_cache=False), fc.patch(enable_autograd_cache=True):
        yield tmp_path / "inductor_cache"
