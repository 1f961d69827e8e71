"""Fixtures every test gets, and the one rule for GPU tests: a test in a file whose name ends in ``_cuda.py``
(wherever it lives under tests/) is marked ``gpu`` and skipped without a CUDA device.

Under pytest-xdist (the README's test command runs ``-n 2 --dist loadfile``: each file on one worker, so that a
module's shared fixtures run once) each worker's torch takes its share of the cores, not all of them."""
import os

import pytest
import torch

GPU_TEST_FILE_SUFFIX = "_cuda.py"


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="no CUDA device") if not torch.cuda.is_available() else None
    for item in items:
        if item.path.name.endswith(GPU_TEST_FILE_SUFFIX):
            item.add_marker(pytest.mark.gpu)
            if no_cuda is not None:
                item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """A fresh Dynamo and seed for each test; a test that leaves PyTorch's ``activation_memory_budget`` changed
    fails (it would change every later partition on its worker: patch it in a ``with`` instead)."""
    from torch._functorch import config as functorch_config

    budget = functorch_config.activation_memory_budget
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
    left = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = budget
    assert left == budget, f"the test left torch._functorch.config.activation_memory_budget at {left} ({budget} before)"


# ------------------------------------------------------------------ dumps shared by the dump, CLI, browser tests
# Each is compiled once per run; a test that changes one works on a copy.
@pytest.fixture(scope="session")
def kept_dump(tmp_path_factory):
    """The toy layer's dump with its top-k kept (``save=``): (folder, backend)."""
    from tests.support.dumps import toy_dump
    folder = tmp_path_factory.mktemp("kept_dump")
    return folder, toy_dump(folder, policy=True)


@pytest.fixture(scope="session")
def plain_dump(tmp_path_factory):
    """The toy layer's dump under PyTorch's own partition (no policy): (folder, backend)."""
    from tests.support.dumps import toy_dump
    folder = tmp_path_factory.mktemp("plain_dump")
    return folder, toy_dump(folder, policy=False)


@pytest.fixture(scope="session")
def xss_dump(tmp_path_factory):
    """The dump of a layer whose must-save op's source line holds a script tag: (folder, backend)."""
    from tests.support.dumps import xss_dump
    folder = tmp_path_factory.mktemp("xss_dump")
    return folder, xss_dump(folder)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A private, empty Inductor/AOTAutograd cache dir with both caches on."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    from torch._functorch import config as fc
    from torch._inductor import config as ic
    with ic.patch(fx_graph_cache=True, fx_graph_remote_cache=False), fc.patch(enable_autograd_cache=True):
        yield tmp_path / "inductor_cache"
