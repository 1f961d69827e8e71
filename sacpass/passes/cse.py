"""cse_pass: merge the joint graph's duplicate pure nodes before anything prices or tags them.

Requires: an AOTAutograd joint graph, before the tag pass.
Ensures: the graph PyTorch's min-cut would partition after its own common-subexpression elimination (dead code
removed, then ``fx_graph_cse``, when ``torch._functorch.config.cse`` is on, as it is by default), so that each
value the passes see is one the partition can keep. Two projections of one input (a query's and a key's
linear, an MLP's gate and up projections) quantise that input twice in the traced graph and once after the
merge: a planner that priced both would spend its budget on a copy the partition never makes.
"""
from __future__ import annotations

import torch.fx

__all__ = ["cse_pass"]


def cse_pass(gm: torch.fx.GraphModule) -> int:
    """Merge ``gm``'s duplicate nodes in place, as the min-cut partitioner does first. Returns how many nodes
    went (0 with ``torch._functorch.config.cse`` off: the partition keeps them too)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse

    if not functorch_config.cse:
        return 0
    gm.graph.eliminate_dead_code()
    before = len(gm.graph.nodes)
    gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    return before - len(gm.graph.nodes)
