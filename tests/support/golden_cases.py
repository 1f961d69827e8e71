"""The compiled cases behind the golden graph tests (and the dump/CLI/browser tests).

Every case compiles one layer with ``inner="aot_eager"`` (the same partition as Inductor, executed eagerly:
fast on CPU) and runs one forward + backward. ``*_baseline`` cases use the sacpass backend with an empty
policy, i.e. PyTorch's own partition; ``*_sacpass`` cases apply the policy. Each case is built once per
process (``build``), so several tests can compare the same compiled graphs.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

import sacpass
from tests.support.toy import ToyLayer

TOY_TOPK = "sacpass_toy::topk_ids"
GLM_TOPK = "glm52::dsa_topk_indices"
T = 32  # tokens per GLM case: 2 packed sequences of 16


def glm_available() -> bool:
    try:
        from glm52_model import GLM52Config, GLM52ForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def _toy(be: sacpass.Backend, *, dynamic: bool = False, **kw) -> sacpass.Backend:
    torch.manual_seed(0)
    model = torch.compile(ToyLayer(**kw), backend=be, fullgraph=True, dynamic=dynamic)
    x = torch.randn(24, 32, requires_grad=True)
    model(x).square().sum().backward()
    return be


def _aot(save=None, registered=False) -> sacpass.Backend:
    return sacpass.backend(save=save, inner="aot_eager", use_registered=registered, save_discrete=registered)


# ------------------------------------------------------------------------------------------- GLM-5.2 tiny
def _glm_inputs(cfg):
    from glm52_model.model import packed_ranges

    x = torch.randn(T, cfg.hidden_size, requires_grad=True)
    positions, starts, ends, _ = packed_ranges(torch.tensor([0, T // 2, T]), T)
    return x, positions, starts, ends


def _shared_ids(starts: torch.Tensor, ends: torch.Tensor, topk: int) -> torch.Tensor:
    """Valid causal IDs for a shared-top-k layer: the first ``topk`` visible keys, -1 past the range."""
    ids = starts[:, None].long() + torch.arange(topk)[None, :]
    return torch.where(ids < ends[:, None].long(), ids, -1).to(torch.int32)


def _glm_layer(policy: dict, layer: int, **cfg_kw) -> sacpass.Backend:
    from glm52_model import GLM52Config, GLM52ForCausalLM  # registers torch.ops.glm52.* first

    be = _aot(**policy)
    torch.manual_seed(0)
    cfg = GLM52Config.tiny(**cfg_kw)
    block = GLM52ForCausalLM(cfg).layers[layer]
    x, positions, starts, ends = _glm_inputs(cfg)
    ids = None if block.compute_topk else _shared_ids(starts, ends, cfg.index_topk)
    out, _ = torch.compile(block, backend=be, fullgraph=True)(x, positions, starts, ends, ids)
    out.square().sum().backward()
    return be


def _glm_mtp(policy: dict) -> sacpass.Backend:
    from glm52_model import GLM52Config, GLM52ForCausalLM

    be = _aot(**policy)
    torch.manual_seed(0)
    cfg = GLM52Config.tiny()
    mtp = GLM52ForCausalLM(cfg).mtp[0]
    hidden, positions, starts, ends = _glm_inputs(cfg)
    embeds = torch.randn(T, cfg.hidden_size, requires_grad=True)
    ids = _shared_ids(starts, ends, cfg.index_topk)
    out = torch.compile(mtp, backend=be, fullgraph=True)(hidden, embeds, positions, starts, ends, ids)
    out.square().sum().backward()
    return be


CASES: dict[str, Callable[[], sacpass.Backend]] = {
    "toy_baseline": lambda: _toy(_aot()),
    "toy_sacpass": lambda: _toy(_aot([TOY_TOPK])),
    "toy_no_checkpoint": lambda: _toy(_aot([TOY_TOPK]), checkpointed=False),
    "toy_dynamic_sacpass": lambda: _toy(_aot([TOY_TOPK]), dynamic=True),
}
BASELINE, SACPASS, REGISTERED = {}, {"save": [GLM_TOPK]}, {"registered": True}
GLM_CASES: dict[str, Callable[[], sacpass.Backend]] = {
    "glm_dense_baseline": lambda: _glm_layer(BASELINE, 0),
    "glm_dense_sacpass": lambda: _glm_layer(SACPASS, 0),
    "glm_moe_baseline": lambda: _glm_layer(BASELINE, 1),
    "glm_moe_sacpass": lambda: _glm_layer(SACPASS, 1),
    # sacpass.backend() with no options: the registered top-k and the default discrete decisions (the router)
    "glm_moe_default": lambda: _glm_layer(REGISTERED, 1),
    "glm_fp8_sacpass": lambda: _glm_layer(SACPASS, 0, fp8=True),
    # FP8 changes what is saved the same way with or without the policy: one case keeps the test fast
    # shared-top-k and MTP layers take the IDs as input: there is no top-k for a policy to keep
    "glm_shared_topk": lambda: _glm_layer(REGISTERED, 2),
    "glm_mtp": lambda: _glm_mtp(REGISTERED),
    "glm_no_checkpoint": lambda: _glm_layer(SACPASS, 1, recompute=False),
}


@functools.lru_cache(maxsize=None)
def build(name: str) -> sacpass.Backend:
    """The backend of case ``name`` after one compiled forward + backward (built once per process)."""
    torch._dynamo.reset()
    try:
        return {**CASES, **GLM_CASES}[name]()
    finally:
        torch._dynamo.reset()
