"""Graph passes, one module each (``<verb>_pass(...)``, a docstring stating what each requires and ensures).

In the order a compile runs them:

- ``repair_module_paths_pass`` (Dynamo graph): module paths of checkpointed modules however they were called;
- ``route_checkpoints_pass`` (Dynamo graph, before AOTAutograd): plain checkpoints tagged the torch 2.13 way;
- ``cse_pass`` (joint graph): duplicate pure nodes merged, as PyTorch's min-cut does first;
- ``tag_policy_pass`` (joint graph): the policy's save / offload / recompute tags;
- ``keep_decisions_pass`` (joint graph): discrete decisions saved as int32, their values rebuilt by gathers;
- ``plan_pass`` (joint graph): the memory budget and the planner;
- ``offload_pass`` (forward and backward graphs, after PyTorch's min-cut): offloaded values to the host.

``knapsack.py`` is no pass: the plan pass's whole-value choice (``best_subset``).
"""
from .checkpoint_regions import route_checkpoints_pass
from .cse import cse_pass
from .discrete import keep_decisions_pass
from .module_paths import repair_module_paths_pass
from .offload import offload_pass
from .plan import plan_pass
from .tag_policy import TagRecord, TagResult, tag_policy_pass

__all__ = ["repair_module_paths_pass", "route_checkpoints_pass", "cse_pass", "tag_policy_pass", "keep_decisions_pass", "plan_pass", "offload_pass",
           "TagRecord", "TagResult"]
