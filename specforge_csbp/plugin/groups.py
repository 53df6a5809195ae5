"""CSBP process groups, created right after SpecForge's `init_distributed` in every worker.

    world ranks 0..W-1, W = dp_replicas x cp_size, cp fastest:

        cp group d  = ranks d*cp .. d*cp + cp-1      (share one sample's context; KV gathers run here)
        dp group c  = ranks c, c+cp, c+2cp, ...       (same CP rank in every replica)

    W = 4, cp = 2:   cp groups {0,1} {2,3}    dp groups {0,2} {1,3}

SpecForge keeps its own groups (its DDP gradient all-reduce and metric reductions run on WORLD). The CSBP
groups are always separate communicators (`new_group`, even when one spans every rank): a collective of the
sharded attention's backward must never interleave with DDP's asynchronous all-reduce on the same group.
Each CP group has a gloo twin for host metadata (which samples a micro-step trains): exchanging it over NCCL
would copy it to the GPU and back, a host-GPU sync at every micro-step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["CSBPGroups", "current", "destroy", "init_groups", "rank_sets"]


@dataclass(frozen=True)
class CSBPGroups:
    cp_size: int
    dp_replicas: int
    cp_rank: int
    dp_rank: int
    cp_group: dist.ProcessGroup | None  # None when cp_size == 1
    dp_group: dist.ProcessGroup | None  # None when dp_replicas == 1
    cp_host_group: dist.ProcessGroup | None = None  # gloo, same ranks as cp_group: CPU tensors only


_CURRENT: CSBPGroups | None = None


def rank_sets(world: int, cp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(cp groups, dp groups) as rank lists, cp fastest (see the picture above)."""
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"--cp-size {cp_size} does not divide the world size {world}")
    dp = world // cp_size
    return [list(range(d * cp_size, (d + 1) * cp_size)) for d in range(dp)], [
        list(range(c, world, cp_size)) for c in range(cp_size)
    ]


def init_groups(cp_size: int) -> CSBPGroups:
    """Every rank calls this with the same cp_size (new_group is collective)."""
    global _CURRENT
    world, rank = dist.get_world_size(), dist.get_rank()
    cp_sets, dp_sets = rank_sets(world, cp_size)
    dp = world // cp_size
    cp_group = dp_group = cp_host_group = None
    if cp_size > 1:
        for ranks in cp_sets:
            g = dist.new_group(ranks)
            host = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                cp_group, cp_host_group = g, host
    if dp > 1:
        for ranks in dp_sets:
            g = dist.new_group(ranks)
            if rank in ranks:
                dp_group = g
    _CURRENT = CSBPGroups(cp_size, dp, rank % cp_size, rank // cp_size, cp_group, dp_group, cp_host_group)
    return _CURRENT


def current() -> CSBPGroups:
    """The groups of this worker; a single-process default when no distributed run is active."""
    if _CURRENT is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("CSBP groups were not initialised; start training through the CSBP launcher")
        return CSBPGroups(1, 1, 0, 0, None, None)
    return _CURRENT


def destroy() -> None:
    global _CURRENT
    for g in (_CURRENT.cp_group, _CURRENT.dp_group, _CURRENT.cp_host_group) if _CURRENT is not None else ():
        if g is not None:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001, S110 - already torn down with the default group
                pass
    _CURRENT = None
