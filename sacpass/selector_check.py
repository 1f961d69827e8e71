"""The explicit-selector check: every selector the user named must match in some graph of the compile.

The rule: an explicit selector must match in at least one graph of the compile; a graph that does not hold
the selected module or op (a graph before a graph break, a loss graph) is no error by itself. It is checked
once per backend, when the first backward through one of its graphs starts: by then the model's forward is
done, so every graph of the step has been compiled. An unmatched selector raises
:class:`~sacpass.UnmatchedSelectorError` (``strict=True``) or warns, and the message lists what the graphs
hold, nearest to the selector first.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .errors import UnmatchedSelectorError, warn
from .graph_breaks import hint
from .nodes import module_stack, node_op
from .partitioner.context import PartitionResult
from .policies import Policy
from .report import Report
from .selectors import nearest_first, selector_parts

__all__ = ["SelectorCheck", "unmatched"]


def unmatched(reports: Sequence[Report], policy: Policy, exact: Sequence = ()) -> list[str]:
    """The explicit selectors of ``policy`` that matched in none of ``reports``, and the ModelPlan(exact=)
    selectors ``exact`` that named none of their planner's values."""
    matched = {t["selector"] for r in reports for t in r.tagged}
    named = {d.exact for r in reports for d in r.decisions}
    return [str(s) for s in policy.explicit if str(s) not in matched] + [str(s) for s in exact if str(s) not in named]


def plan_exact(plan) -> tuple:
    """A ModelPlan's exact= selectors (none for other plans)."""
    return tuple(getattr(plan, "exact", ()) or ())


def _present(results: Sequence[PartitionResult], policy: Policy, missing: list[str], backend_plan=None) -> str:
    """What the partitioned forward graphs hold, nearest to the unmatched selectors first."""
    modules, ops = set(), set()
    for result in results:
        for node in result.forward.graph.nodes:
            op = node_op(node)
            if op is not None:
                ops.add(op._schema.name)
                modules.update(f"{path} ({cls})" if path else cls for path, cls in module_stack(node))
    parts = [selector_parts(s) for s in policy.explicit + plan_exact(backend_plan) if str(s) in missing]
    pattern = " ".join(m for m, _ in parts if m)
    text = f" Ops present, nearest first: {', '.join(nearest_first(parts[0][1], ops)) or 'none'}." if parts else ""
    if pattern:
        text += f" Module paths present, nearest first: {', '.join(nearest_first(pattern, modules)) or 'none'}."
    return text


class SelectorCheck:
    """One backend's check, run once: ``wrap`` a compiled graph so its first backward runs the check, which
    reads the backend's ``reports``, ``results``, ``policy`` and ``strict`` as they are then."""

    def __init__(self, backend):
        self._backend = backend
        self.done = False

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled``, calling the check when the first backward through its outputs starts."""
        from torch.utils._pytree import tree_leaves

        def run(*args):
            out = compiled(*args)
            if not self.done:
                grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                if grads:
                    torch.autograd.graph.register_multi_grad_hook(grads, self.check, mode="any")
            return out

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    def check(self, *_grads) -> None:
        if self.done:
            return
        self.done = True
        backend = self._backend
        reports, policy, plan = backend.reports, backend.policy, backend.config.plan
        missing = unmatched(reports, policy, plan_exact(plan))
        if not missing:
            return
        regions = [r.graph for r in reports if r.unmatched]
        exact = [m for m in missing if m in {str(s) for s in plan_exact(plan)}]
        msg = (f"sacpass: selector(s) {', '.join(missing)} matched no forward node in any graph of this compile "
               f"({len(reports)} graph(s); checked in {', '.join(regions) or 'none'}: the graphs holding its "
               f"module or, for a selector without one, a checkpointed region)"
               + (f"; ModelPlan(exact={', '.join(exact)}) names none of the values its planner weighed (those a "
                  f"checkpointed region's backward reads: each graph's report.decisions)" if exact else "")
               + f". Check the op name and module pattern against the graphs (module paths are "
               f"relative to the module given to torch.compile; dump_dir= writes the graphs)."
               f"{_present(backend.results, policy, missing, plan)}{hint()}")
        if backend.strict:
            raise UnmatchedSelectorError(msg + " Pass strict=False to only warn.")
        warn(msg)
