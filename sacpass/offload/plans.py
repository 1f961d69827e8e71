"""The model plans this process's backends were built with: what the runtime makes a plan's state from, by the
key its compiled graphs' stash ops name (at the first stash, a cached graph's included), and what a plan as the
user gave it was resolved to (what the readers, :func:`sacpass.offload.placements` and the others, accept in its
place). A plan is read through its ``key`` and ``resolved`` only, so the runtime never imports
:mod:`sacpass.plan`, which builds them.
"""
from __future__ import annotations

__all__ = ["declare", "declared_plan", "resolved_plan"]

_DECLARED: dict = {}  # plan key -> the plan a backend of this process was built with


def declared_plan(key: str):
    """The model plan a backend of this process was built with, by its key (what its compiled graphs' stash ops
    name): the runtime makes the plan's state from it at its first stash, cached graphs' included."""
    return _DECLARED.get(key)


_RESOLVED: dict = {}  # a plan as given -> as the backend resolved it


def declare(plan, given=None):
    """Make a resolved model plan known to this process's runtime (by its key), before any graph runs;
    ``given``: the plan it was resolved from, which the runtime's readers then accept in its place."""
    _DECLARED.setdefault(plan.key, plan)
    if given is not None:
        _RESOLVED[given] = plan
    return plan


def resolved_plan(plan):
    """``plan`` as a backend of this process resolved it (itself when it leaves nothing open), or None before
    any has."""
    return plan if plan.resolved else _RESOLVED.get(plan)
