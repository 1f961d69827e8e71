"""best_subset: the items that hold the most value within several capacities (a 0/1 knapsack), for the planner.

Taking values densest first (recompute time per byte) is the fractional knapsack's answer, and a whole-value
knapsack can lose much of a budget to it: a region's share that holds either its attention output (4 GB, 49 ms
to recompute) or a dozen projections' inputs (4.4 GB, 41 ms together), the projections a little denser, ends
up with the projections and the remainder of the share unused. The search here starts from the densest-first
fill and only ever replaces it by a better one.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["best_subset"]

MAX_WORK = 2_000_000  # search nodes x items before the best fill found so far is taken (about a second at most)


def best_subset(values: Sequence[float], weights: Sequence[Sequence[int]], capacities: Sequence[int], *,
                max_work: int = MAX_WORK) -> list[int]:
    """Indices of items whose summed ``values`` is greatest with, for every k, ``sum(weights[i][k]) <=
    capacities[k]``: branch and bound over the items, densest first, bounded at each step by the least of the
    fractional fills of each capacity alone. Exact when the search ends within ``max_work`` (search nodes times
    items); else the best fill found, never worse than densest first. Whatever the search leaves room for is
    then filled densest first (items of no value too), so no item left out fits what is left. Returned in the
    order of ``values``."""
    n, dims = len(values), len(capacities)
    fits = [i for i in range(n) if all(0 <= weights[i][k] <= capacities[k] for k in range(dims))]

    def density(i: int) -> float:
        load = sum(weights[i][k] / capacities[k] for k in range(dims) if capacities[k] > 0)
        return values[i] / load if load > 0 else float("inf")

    order = sorted(fits, key=lambda i: (-density(i), i))
    # per capacity, the items by value per unit of it, for the fractional bound
    by_dim = [sorted(order, key=lambda i, k=k: -(values[i] / weights[i][k]) if weights[i][k] else float("-inf"))
              for k in range(dims)]
    rank = {i: r for r, i in enumerate(order)}

    def bound(start: int, left: list[int]) -> float:
        best = float("inf")
        for k in range(dims):
            room, total = left[k], 0.0
            for i in by_dim[k]:
                if rank[i] < start:
                    continue
                w = weights[i][k]
                if w <= room:
                    room -= w
                    total += values[i]
                else:
                    total += values[i] * room / w
                    break
            best = min(best, total)
        return best

    def fill(chosen: list[int], left: list[int], start: int = 0) -> tuple[list[int], float]:
        chosen, left = list(chosen), list(left)
        for i in order[start:]:
            if i not in chosen and all(weights[i][k] <= left[k] for k in range(dims)):
                chosen.append(i)
                for k in range(dims):
                    left[k] -= weights[i][k]
        return chosen, sum(values[i] for i in chosen)

    best_set, best_value = fill([], list(capacities))
    nodes, max_nodes = 0, max_work // max(len(order), 1)

    def search(pos: int, chosen: list[int], value: float, left: list[int]) -> None:
        nonlocal best_set, best_value, nodes
        nodes += 1
        if value > best_value + 1e-12:
            best_set, best_value = list(chosen), value
        if pos == len(order) or nodes > max_nodes or value + bound(pos, left) <= best_value + 1e-12:
            return
        i = order[pos]
        if all(weights[i][k] <= left[k] for k in range(dims)):
            chosen.append(i)
            search(pos + 1, chosen, value + values[i],
                   [left[k] - weights[i][k] for k in range(dims)])
            chosen.pop()
        search(pos + 1, chosen, value, left)

    if len(order) <= 500:  # the search recurses once per item
        search(0, [], 0.0, list(capacities))
    left = [capacities[k] - sum(weights[i][k] for i in best_set) for k in range(dims)]
    chosen, _ = fill(best_set, left)
    return sorted(chosen)
