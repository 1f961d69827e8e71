"""Policies: which selected nodes are must-save and which are must-recompute.

A :class:`Policy` is a frozen, hashable pair of selector tuples. Model code declares the ops it wants
kept with :func:`register_must_save` where it defines them; the backend's default policy is
:func:`registered_policy`. Explicit selectors (``save=``/``recompute=``) must match something in every
compiled graph (strict mode); registered ones apply where the op appears.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .selectors import CollectiveSelector, Selector, SelectorLike, as_selector, as_selectors

__all__ = ["Policy", "register_must_save", "registered_must_save", "registered_policy", "clear_registry"]

_REGISTRY: list[Selector] = []


def register_must_save(selector: SelectorLike) -> Selector:
    """Declare, next to its definition, an op whose outputs the backward must never recompute."""
    sel = as_selector(selector)
    if sel not in _REGISTRY:
        _REGISTRY.append(sel)
    return sel


def registered_must_save() -> tuple[Selector, ...]:
    return tuple(_REGISTRY)


def clear_registry() -> None:
    """Forget every registered must-save selector (tests)."""
    _REGISTRY.clear()


@dataclass(frozen=True)
class Policy:
    """What the must-save pass tags. Hashable; its :meth:`cache_key` enters the compile caches."""

    save: tuple[Selector, ...] = ()  # explicit must-save selectors (strict: must match)
    recompute: tuple[Selector, ...] = ()  # explicit must-recompute selectors (strict: must match)
    registered: tuple[Selector, ...] = field(default=())  # from register_must_save (apply where present)
    defaults: tuple[Selector, ...] = field(default=())  # saved where present, unless a recompute selector matches

    @classmethod
    def build(cls, save: SelectorLike | list | None = None, recompute: SelectorLike | list | None = None,
              use_registered: bool = True, save_collectives: bool = True) -> "Policy":
        save_t, rec_t = as_selectors(save), as_selectors(recompute)
        reg = tuple(s for s in registered_must_save() if s not in save_t) if use_registered else ()
        return cls(save_t, rec_t, reg, (CollectiveSelector(),) if save_collectives else ())

    def all_save(self) -> tuple[Selector, ...]:
        return self.save + self.registered

    def cache_key(self) -> str | None:
        """A stable digest of the policy, or None when a predicate has no stable key (caches bypass)."""
        parts = []
        for kind, sels in (("save", self.save), ("recompute", self.recompute), ("registered", self.registered),
                           ("defaults", self.defaults)):
            for s in sels:
                key = getattr(s, "cache_key", "") if hasattr(s, "cache_key") else ""
                if hasattr(s, "cache_key") and s.cache_key is None:
                    return None
                parts.append(f"{kind}:{s}:{key}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]

    def uncacheable(self) -> list[str]:
        return [str(s) for s in self.save + self.recompute + self.registered
                if getattr(s, "cache_key", "") is None]

    def __str__(self) -> str:
        def j(xs):
            return "[" + ", ".join(str(x) for x in xs) + "]"
        text = f"Policy(save={j(self.save)}, recompute={j(self.recompute)}, registered={j(self.registered)}"
        return text + (f", defaults={j(self.defaults)})" if self.defaults else ")")
