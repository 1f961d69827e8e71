"""Policies: which joint-graph nodes are saved, offloaded or recomputed, and why.

A :class:`Policy` is a frozen, hashable set of selector tuples. Model code declares the ops it wants kept
with :func:`register_must_save` where it defines them. Precedence on one node, strongest first:
explicit ``recompute`` > explicit ``offload`` > explicit ``save`` > registered > defaults (discrete decisions,
functional collectives). Two explicit actions on one node are a :class:`~sacpass.PolicyConflictError`.
:meth:`Policy.action` is that rule, for a joint-graph node (the tag pass) and for an op call at run time
(the eager checkpoint context) alike.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Callable

from .errors import PolicyConflictError, warn
from .selectors import (CollectiveSelector, DiscreteSelector, PredicateSelector, Selector, SelectorLike,
                        as_selector, as_selectors)

__all__ = ["Policy", "register_must_save", "registered_must_save", "clear_registry", "note_registry_used",
           "EXPLICIT_ACTIONS"]

EXPLICIT_ACTIONS = ("recompute", "offload", "save")  # strongest first

_REGISTRY: list[Selector] = []
_graphs_since_registry_change = 0  # graphs compiled with use_registered=True since _REGISTRY last changed


def register_must_save(selector: SelectorLike) -> Selector:
    """Declare, next to its definition, an op whose outputs the backward must never recompute.

    Backends read the registry at each compile. Graphs compiled before a registration keep the policy they
    were compiled under (Dynamo reuses them without asking the backend), so this warns when it comes late."""
    global _graphs_since_registry_change
    sel = as_selector(selector)
    if sel not in _REGISTRY:
        _REGISTRY.append(sel)
        stale, _graphs_since_registry_change = _graphs_since_registry_change, 0
        if stale:
            warn(f"sacpass: register_must_save({sel}) ran after {stale} graph(s) were compiled with "
                 f"use_registered=True under the registry without it; those graphs keep their old policy until "
                 f"they are recompiled (unless torch._dynamo.reset() ran since). Register must-save ops where "
                 f"they are defined, before the first compile, or call torch._dynamo.reset() and run again.")
    return sel


def note_registry_used() -> None:
    """A backend compiled a graph under the registry as it is now (see register_must_save's warning)."""
    global _graphs_since_registry_change
    _graphs_since_registry_change += 1


def registered_must_save() -> tuple[Selector, ...]:
    return tuple(_REGISTRY)


def clear_registry() -> None:
    """Forget every registered must-save selector (tests)."""
    global _graphs_since_registry_change
    _REGISTRY.clear()
    _graphs_since_registry_change = 0


@dataclass(frozen=True)
class Policy:
    """What the tag pass does. Hashable; its :meth:`cache_key` enters the compile caches."""

    save: tuple[Selector, ...] = ()  # explicit must-save selectors (strict: must match)
    recompute: tuple[Selector, ...] = ()  # explicit must-recompute selectors (strict: must match)
    offload: tuple[Selector, ...] = ()  # explicit offload-to-host selectors (strict: must match)
    registered: tuple[Selector, ...] = field(default=())  # from register_must_save (apply where present)
    defaults: tuple[Selector, ...] = field(default=())  # saved where present unless an explicit action wins

    @classmethod
    def build(cls, save: SelectorLike | list | None = None, recompute: SelectorLike | list | None = None,
              offload: SelectorLike | list | None = None, *, use_registered: bool = True,
              save_collectives: bool = True, save_discrete: bool = True) -> "Policy":
        save_t, rec_t, off_t = as_selectors(save), as_selectors(recompute), as_selectors(offload)
        for a, an, b, bn in ((save_t, "save", rec_t, "recompute"), (save_t, "save", off_t, "offload"),
                             (off_t, "offload", rec_t, "recompute")):
            both = [str(s) for s in a if s in b]
            if both:
                raise PolicyConflictError(
                    f"sacpass: selector(s) {', '.join(both)} appear in both {an}= and {bn}=; one value gets one "
                    f"action. Remove it from one of {an}= / {bn}=, or narrow one with a module pattern "
                    f"('<module>::ns::op').")
        defaults = ((DiscreteSelector(),) if save_discrete else ()) + \
            ((CollectiveSelector(),) if save_collectives else ())
        policy = cls(save_t, rec_t, off_t, (), defaults)
        return policy.with_registry() if use_registered else policy

    def with_registry(self) -> "Policy":
        """This policy with ``registered`` read from the registry now (an explicit save= wins)."""
        reg = tuple(s for s in registered_must_save() if s not in self.save)
        return self if reg == self.registered else replace(self, registered=reg)

    @property
    def explicit(self) -> tuple[Selector, ...]:
        """Selectors the user named: each must match where it can (strict)."""
        return self.save + self.recompute + self.offload

    def action(self, selects: Callable[[Selector], bool], what: Callable[[], str]) -> tuple[str, Selector] | None:
        """(``"recompute"`` | ``"offload"`` | ``"save"``, the selector) this policy gives one node or op call,
        by precedence (see the module docstring); None when no selector picks it. ``selects(s)`` says whether
        selector ``s`` picks it; ``what()`` names it in the error raised when two explicit actions do."""
        named = [(kind, s) for kind in EXPLICIT_ACTIONS
                 for s in [next((s for s in getattr(self, kind) if selects(s)), None)] if s is not None]
        if len(named) > 1:
            order = ("save", "offload", "recompute")
            (ka, sa), (kb, sb) = sorted(named, key=lambda ks: order.index(ks[0]))[:2]
            raise PolicyConflictError(
                f"sacpass: {what()} is selected both to {ka} ({sa}) and to {kb} ({sb}). Remove it from one of "
                f"{ka}= / {kb}=, or narrow a selector with a module pattern ('<module>::ns::op').")
        if named:
            return named[0]
        kept = next((s for s in self.registered + self.defaults if selects(s)), None)
        return ("save", kept) if kept is not None else None

    @property
    def empty(self) -> bool:
        return not (self.explicit or self.registered or self.defaults)

    def _keys(self) -> tuple[list[str], list[str]]:
        """(one part per selector, why each uncacheable predicate is so); predicates keyed now."""
        parts, why = [], []
        for kind in ("save", "recompute", "offload", "registered", "defaults"):
            for s in getattr(self, kind):
                key, reason = s.key() if isinstance(s, PredicateSelector) else ("", "")
                if key is None:
                    why.append(f"{s} {reason}")
                parts.append(f"{kind}:{s}:{key}")
        return parts, why

    def cache_key(self) -> str | None:
        """A stable digest of the policy, or None when a predicate has no stable key (caches bypass).
        Predicate keys are computed at each call: they follow the globals a predicate reads."""
        parts, why = self._keys()
        return None if why else hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]

    def uncacheable(self) -> list[str]:
        """One line per predicate without a stable key: the predicate and what it reads."""
        return self._keys()[1]

    def __str__(self) -> str:
        def j(xs):
            return "[" + ", ".join(str(x) for x in xs) + "]"
        text = f"Policy(save={j(self.save)}, recompute={j(self.recompute)}"
        if self.offload:
            text += f", offload={j(self.offload)}"
        text += f", registered={j(self.registered)}"
        return text + (f", defaults={j(self.defaults)})" if self.defaults else ")")
