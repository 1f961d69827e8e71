"""route_checkpoints_pass: give every plain checkpoint the tagging torch >= 2.13 gives it.

Runs on the Dynamo graph, before AOTAutograd traces the joint graph (the only pass that does).

Why: under torch.compile a plain ``checkpoint(f)`` (no ``context_fn``) is traced as
``tag_activation_checkpoint(body)``. Up to torch 2.12 its tags are stamped on the *Dynamo* nodes of the
body, so the ops a custom ``torch.autograd.Function`` runs (a desugared ``autograd_function_apply``
whose forward is its own subgraph) reach the joint graph untagged; the min-cut partitioner then treats
them as ordinary forward ops outside any checkpoint and saves compute-heavy ones (FP8 GEMMs, their
quantised operands) instead of recomputing them. torch 2.13 routes every plain checkpoint through the
selective-checkpoint dispatch mode with an always-recompute policy, which tags every op, those inside
autograd.Functions included. PyTorch SAC (``context_fn``) goes that way on every version.

Requires: the GraphModule Dynamo hands to a backend.
Ensures: on a torch whose plain checkpoint stamps Dynamo nodes only (detected, not version-sniffed),
every ``tag_activation_checkpoint`` body without a ``context_fn`` that contains an
``autograd_function_apply`` gets ``meta["_checkpoint_context_fn"]`` = PyTorch's
``create_selective_checkpoint_contexts`` with an always-recompute policy, so AOTAutograd traces it the way
torch 2.13 does. Bodies without autograd.Functions (identical either way) and bodies with a user
``context_fn`` are left alone; on torch >= 2.13 the pass changes nothing. Returns the routed bodies' names.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["route_checkpoints_pass", "plain_checkpoint_misses_autograd_functions", "always_recompute_context_fn"]

_CONTEXT_KEY = "_checkpoint_context_fn"


def plain_checkpoint_misses_autograd_functions() -> bool:
    """True on torches whose plain checkpoint under compile tags only the Dynamo nodes of its body
    (torch <= 2.12: ``TagActivationCheckpoint.tag_nodes``); torch 2.13 removed that path."""
    from torch._higher_order_ops.wrap import TagActivationCheckpoint
    return hasattr(TagActivationCheckpoint, "tag_nodes")


def _always_recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def always_recompute_context_fn():
    """PyTorch's SAC contexts with a policy that recomputes every op (a plain checkpoint, torch 2.13's way).
    A module-level function: picklable, so the Dynamo graph's metadata survives deep copies and caches."""
    return create_selective_checkpoint_contexts(_always_recompute)


def _hop(name: str):
    return getattr(torch.ops.higher_order, name, None)


def _submodule(owner: torch.fx.GraphModule, node: torch.fx.Node):
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    try:
        mod = owner.get_submodule(node.target)
    except AttributeError:
        return None
    return mod if isinstance(mod, torch.fx.GraphModule) else None


def _contains_autograd_function(gm: torch.fx.GraphModule, apply_hop) -> bool:
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule) and mod.graph.find_nodes(op="call_function", target=apply_hop):
            return True
    return False


def route_checkpoints_pass(gm: torch.fx.GraphModule, *, force: bool = False) -> list[str]:
    """Route plain checkpoint bodies holding autograd.Functions through PyTorch's always-recompute SAC
    tagging (see the module docstring). ``force`` applies it on any torch (tests)."""
    if not (force or plain_checkpoint_misses_autograd_functions()):
        return []
    ckpt_hop, apply_hop = _hop("tag_activation_checkpoint"), _hop("autograd_function_apply")
    if ckpt_hop is None or apply_hop is None:
        return []
    routed = []
    for owner_name, owner in gm.named_modules():
        if not isinstance(owner, torch.fx.GraphModule):
            continue
        for node in owner.graph.find_nodes(op="call_function", target=ckpt_hop):
            body = _submodule(owner, node.args[0] if node.args else None)
            if body is None or _CONTEXT_KEY in body.meta or not _contains_autograd_function(body, apply_hop):
                continue
            body.meta[_CONTEXT_KEY] = always_recompute_context_fn
            routed.append(".".join(p for p in (owner_name, node.args[0].target) if p))
    return routed
