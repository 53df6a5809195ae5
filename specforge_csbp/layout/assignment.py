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

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Assignment", "assign_dual_end"]


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
