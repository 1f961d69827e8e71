"""Small graph dumps for the dump, CLI and browser tests (toy layer, aot_eager: a few seconds each)."""
from __future__ import annotations

import os

import torch

import sacpass
from tests.support.toy import ToyLayer
from tests.support.xss_layer import EvilLayer

TOY_TOPK = "sacpass_toy::topk_ids"


def _run(model: torch.nn.Module, be: sacpass.Backend) -> sacpass.Backend:
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(24, 32, requires_grad=True)
    torch.compile(model, backend=be, fullgraph=True)(x).square().sum().backward()
    torch._dynamo.reset()
    return be


def toy_dump(directory: str | os.PathLike, *, policy: bool = True) -> sacpass.Backend:
    """The toy layer dumped into ``directory``: with the top-k kept (policy) or PyTorch's own partition."""
    torch.manual_seed(0)
    be = sacpass.backend(save=[TOY_TOPK] if policy else None, inner="aot_eager", use_registered=False, save_discrete=False,
                         dump_dir=directory)
    return _run(ToyLayer(), be)


def xss_dump(directory: str | os.PathLike) -> sacpass.Backend:
    """A layer whose must-save op's source line contains ``</script><script>...`` (xss_layer.PAYLOAD)."""
    torch.manual_seed(0)
    be = sacpass.backend(save=[TOY_TOPK], inner="aot_eager", use_registered=False, save_discrete=False, dump_dir=directory)
    return _run(EvilLayer(), be)
