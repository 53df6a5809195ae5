"""Dual-end ownership of whole blocks (or DFlash anchors) by cost.

Items are sorted by cost and the heaviest is paired with the lightest; with block costs rising along the
sequence this pairs block b with block B-1-b:

    blocks:  0  1  2  3  4  5  6  7        P = 2
    pairs:  (0,7)  (1,6)  (2,5)  (3,4)      every pair costs the same
    ranks:   r0     r1     r0     r1

Pairs are then placed greedily (largest first onto the least-loaded rank). When pairs are too coarse to
balance (B % 2P != 0, or P <= B < 2P, where there are fewer pairs than ranks) the same greedy placement of
single items is also tried and the assignment with the lower maximum load wins; ties keep the pairs.
B < P is an error: some rank would own nothing and its corrupted stream would be empty.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Assignment", "assign_dual_end", "assign_near_home"]


@dataclass(frozen=True)
class Assignment:
    """items[r] = sorted item ids owned by rank r; loads[r] = their summed cost."""

    items: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """max load / mean load (1.0 is perfect balance)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean > 0 else 1.0

    def owner_of(self) -> list[int]:
        owner = [-1] * sum(len(i) for i in self.items)
        for rank, items in enumerate(self.items):
            for item in items:
                owner[item] = rank
        return owner


def _greedy(units: list[tuple[int, ...]], costs: Sequence[float], world_size: int) -> Assignment:
    unit_cost = [sum(costs[i] for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-unit_cost[u], units[u]))
    loads = [0.0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    counts = [0] * world_size
    for u in order:
        # least load first; among equal loads the rank with fewer units, then the lowest rank
        r = min(range(world_size), key=lambda r: (loads[r], counts[r], r))
        loads[r] += unit_cost[u]
        counts[r] += 1
        owned[r].extend(units[u])
    return Assignment(tuple(tuple(sorted(o)) for o in owned), tuple(loads))


def assign_dual_end(costs: Sequence[float], world_size: int, *, what: str = "blocks") -> Assignment:
    """Assign items with the given costs to `world_size` ranks, every rank owning at least one."""
    n = len(costs)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n < world_size:
        raise ValueError(
            f"{what}: {n} {what} cannot be spread over {world_size} ranks; "
            f"need at least one per rank ({what} >= world_size)"
        )
    order = sorted(range(n), key=lambda i: (costs[i], i))
    pairs: list[tuple[int, ...]] = [(order[i], order[n - 1 - i]) for i in range(n // 2)]
    if n % 2:
        pairs.append((order[n // 2],))
    # Fewer pairs than ranks (P <= B < 2P): split the heaviest pairs until every rank can own one unit.
    while len(pairs) < world_size:
        heaviest = max((p for p in pairs if len(p) == 2), key=lambda p: (sum(costs[i] for i in p), p))
        pairs.remove(heaviest)
        pairs.extend([(heaviest[0],), (heaviest[1],)])
    paired = _greedy(pairs, costs, world_size)
    single = _greedy([(i,) for i in range(n)], costs, world_size)
    return single if max(single.loads) < max(paired.loads) else paired


def assign_near_home(
    costs: Sequence[float],
    home: Sequence[int],
    world_size: int,
    *,
    run: int,
    slack: float,
    halve: bool = False,
    what: str = "anchors",
) -> tuple[tuple[int, ...], ...] | None:
    """Items in position order, each with a cost and a home rank (where the data it reads lives): runs of
    `run` consecutive items go to the rank most of them call home; then, while the most loaded rank is over
    the target - the maximum load of `assign_dual_end` times (1 + slack) - it hands the unit whose cost is
    nearest half the gap to the least loaded rank, or swaps a unit for a cheaper one of that rank (runs
    first; its runs become single items when neither fits). Returns each rank's items, its whole runs first
    (in order) then the rest (in order), or None when the target cannot be reached - with `halve`, only
    after runs of run / 2, run / 4, ..., 1 could not reach it either.

        homes (P = 2):   0 0 0 0 | 1 1 1 1 | 1 1 1 1 | 0 0 0 0      run = 4
        runs:            [ r0  ]   [ r1  ]   [ r2  ]   [ r3  ]
        owners:             0         1         1         0          (balanced: nothing moves)

    A move or swap lowers the sum of squared loads (what changes hands is below the gap): no cycles."""
    target = max(assign_dual_end(costs, world_size, what=what).loads) * (1 + slack)  # n < P: the one-line error
    for length in [run >> k for k in range(run.bit_length())] if halve else [run]:
        items = _near_home(costs, home, world_size, length, target)
        if items is not None:
            return items
    return None


def _near_home(
    costs: Sequence[float], home: Sequence[int], world_size: int, run: int, target: float
) -> tuple[tuple[int, ...], ...] | None:
    """`assign_near_home` with runs of exactly `run` items and the given target load."""
    n, P = len(costs), world_size
    units = [list(range(i, min(i + run, n))) for i in range(0, n, run)]
    owner = [max(range(P), key=lambda r: (sum(home[i] == r for i in u), -r)) for u in units]  # ties: lowest
    cost = [sum(costs[i] for i in u) for u in units]
    loads = [0.0] * P
    for u, r in enumerate(owner):
        loads[r] += cost[u]
    for _ in range(2 * n):
        heavy = max(range(P), key=lambda r: (loads[r], -r))
        if loads[heavy] <= target:
            break
        light = min(range(P), key=lambda r: (loads[r], r))
        gap = loads[heavy] - loads[light]
        fits = [u for u in range(len(units)) if owner[u] == heavy and cost[u] < gap]
        if fits:
            u = min(fits, key=lambda u: (abs(gap / 2 - cost[u]), u))
            owner[u], loads[heavy], loads[light] = light, loads[heavy] - cost[u], loads[light] + cost[u]
            continue
        swap = _best_swap(units, owner, cost, heavy, light, gap)
        if swap is not None:  # heavy's unit u for light's cheaper unit v: the gap shrinks by their difference
            u, v = swap
            owner[u], owner[v] = light, heavy
            delta = cost[u] - cost[v]
            loads[heavy], loads[light] = loads[heavy] - delta, loads[light] + delta
            continue
        if not any(owner[u] == heavy and len(units[u]) > 1 for u in range(len(units))):
            return None
        split = [[[i] for i in unit] if owner[u] == heavy else [unit] for u, unit in enumerate(units)]
        owner = [owner[u] for u, parts in enumerate(split) for _ in parts]
        units = [part for parts in split for part in parts]
        cost = [sum(costs[i] for i in u) for u in units]
    if max(loads) > target or any(r not in owner for r in range(P)):
        return None
    out = []
    for rank in range(P):
        mine = [units[u] for u in range(len(units)) if owner[u] == rank]
        whole = sorted(i for u in mine if len(u) == run for i in u)
        rest = sorted(i for u in mine if len(u) < run for i in u)
        out.append(tuple(whole + rest))
    return tuple(out)


def _best_swap(units, owner, cost, heavy: int, light: int, gap: float) -> tuple[int, int] | None:
    """(u on heavy, v on light) with 0 < cost[u] - cost[v] < gap, the difference nearest gap / 2."""
    mine = sorted((cost[v], v) for v in range(len(units)) if owner[v] == light)
    values = [c for c, _ in mine]
    best = None
    for u in range(len(units)):
        if owner[u] != heavy:
            continue
        j = bisect.bisect_left(values, cost[u] - gap / 2)
        for k in (j - 1, j):
            if 0 <= k < len(mine) and 0 < cost[u] - mine[k][0] < gap:
                key = (abs(gap / 2 - (cost[u] - mine[k][0])), u, mine[k][1])
                best = key if best is None or key < best else best
    return None if best is None else (best[1], best[2])
