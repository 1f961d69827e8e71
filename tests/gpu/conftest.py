"""GPU tests: every test here is skipped without a CUDA device."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (helpers)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    here = os.path.dirname(os.path.abspath(__file__))
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
