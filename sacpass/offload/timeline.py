"""One step of a model plan as it ran, by region: the reloads that waited, the copies' times, the clock marks of
its forwards and backwards, and what the graphs' cost model expected of them."""
from __future__ import annotations

from dataclasses import dataclass, field

from .clocks import elapsed_ms

__all__ = ["Timeline"]


@dataclass(eq=False)
class Timeline:
    waited: dict[int, int] = field(default_factory=dict)  # region -> reloads not prefetched
    copies: dict[int, dict[str, list]] = field(default_factory=dict)  # region -> its copies' times, each way
    forward_done: dict[int, object] = field(default_factory=dict)  # region -> its forward's work done (first stash)
    backward_began: dict[int, object] = field(default_factory=dict)  # region -> its first unstash
    backward_ended: object = None  # the backward's end (its final callback)
    peak_at_backward: dict[int, int] = field(default_factory=dict)  # region -> the device's running peak as its
    # backward began (with a peak cap on a GPU), in the order the backwards ran
    expected: dict[int, tuple[float, float]] = field(default_factory=dict)  # region -> (forward ms, backward ms)

    def copy_times(self, region: int) -> dict[str, list]:
        """Where region ``region``'s copies are timed, each way."""
        return self.copies.setdefault(region, {"d2h": [], "h2d": []})

    def forward_ms(self) -> dict[int, float | None]:
        """Each region's forward (ms) from the region before's first stash to its own (so it carries the region
        before's stashes: their packing, with compress); the first region's has no start mark (None)."""
        order = sorted(self.forward_done)
        return {p: None if q is None else elapsed_ms(self.forward_done[q], self.forward_done[p])
                for q, p in zip([None] + order[:-1], order)}

    def backward_ms(self) -> dict[int, float | None]:
        """Each region's backward (ms): from its first unstash to that of the region whose backward came next (the
        one before it in the step), the last to the backward's end; None while one is running, or without an
        end mark."""
        began = self.backward_began
        order = sorted(began, reverse=True)  # backward order
        return {p: elapsed_ms(began[p], began[q] if q is not None else self.backward_ended)
                for p, q in zip(order, order[1:] + [None])}

    def regions_ms(self) -> float | None:
        """The step's measured time in its regions: every region's backward and every forward but the first's
        (which has no start mark); None when a mark is missing or its work still runs on the device."""
        backwards, forwards = self.backward_ms(), self.forward_ms()
        forwards.pop(min(forwards, default=None), None)  # the first region's: no start mark
        if not backwards or any(ms is None for ms in [*backwards.values(), *forwards.values()]):
            return None
        return sum(backwards.values()) + sum(forwards.values())
