"""Async all-gather of shared K/V whose backward is an async reduce-scatter, both overlapped with compute.

    forward:   start all-gather(kv shard) ──► local attention (overlaps) ──► wait ──► remote attention
    backward:  remote attention bwd ──► start reduce-scatter(d kv) ──► local attention bwd ──► wait

The pair of autograd Functions relies on the engine running ready nodes in reverse creation order: the
`_Wait` node (created after the local attention) runs its backward first and starts the reduce-scatter;
the local attention's backward then runs before `_Start`'s backward, which waits for the result.

K and V travel fused in one buffer; every rank's segment is padded to the largest shard (`width`). Byte
counts are what a rank sends on a ring: (P-1) segments per all-gather and per reduce-scatter.

The buffer is rank-major with head-major segments, so every rank's K (and V) is one contiguous block:

    gathered  [world * 2, B, Hk, width, D]  =  rank 0: K [B, Hk, width, D], V [...] | rank 1: K, V | ...

    concat()    copies [local ++ the other ranks' segments] into one K and one V (the fused schedule) with
                plain block copies; backward writes the segments' gradients straight into the buffer's
                layout for the reduce-scatter. A token-major buffer ([world * width, 2, B, Hk, D]) would need
                permuted copies and autograd's zero-filled full-size gradients for its strided views
                (benchmarks/flex_layer_bench.py +executor times the difference).
    segments()  every rank's (K, V) as views of the buffer (the overlap schedule attends to them in place;
                regather re-creates exactly those views)
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["COMM_STATS", "CommStats", "GatherHandle", "KVGather", "all_gather_rows"]


@dataclass
class CommStats:
    """Bytes this process sent in attention collectives, by operation."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, nbytes: int) -> None:
        self.bytes_sent[op] += nbytes

    def reset(self) -> None:
        self.bytes_sent.clear()

    @property
    def total(self) -> int:
        return sum(self.bytes_sent.values())


COMM_STATS = CommStats()


class _Pending:
    """State shared by the start/wait nodes of one gather."""

    def __init__(self, group, world: int, stats: CommStats, label: str = ""):
        self.group, self.world, self.stats = group, world, stats
        self.label = label  # suffix of the byte counters' names
        self.work = None
        self.grad_shard: torch.Tensor | None = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, pending: _Pending):
        ctx.pending = pending
        out = shard.new_empty((pending.world * shard.shape[0],) + tuple(shard.shape[1:]))
        pending.work = dist.all_gather_into_tensor(out, shard, group=pending.group, async_op=True)
        pending.stats.add("all_gather" + pending.label, shard.numel() * shard.element_size() * (pending.world - 1))
        return out

    @staticmethod
    def backward(ctx, _grad_from_wait):
        pending = ctx.pending
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        grad, pending.grad_shard = pending.grad_shard, None
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered: torch.Tensor, pending: _Pending):
        ctx.pending = pending
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pending = ctx.pending
        grad = grad.contiguous()
        shard = grad.new_empty((grad.shape[0] // pending.world,) + tuple(grad.shape[1:]))
        pending.work = dist.reduce_scatter_tensor(shard, grad, group=pending.group, async_op=True)
        pending.stats.add("reduce_scatter" + pending.label, shard.numel() * shard.element_size() * (pending.world - 1))
        pending.grad_shard = shard
        return grad, None


def _other_slots(world: int, own: int, local: int, width: int) -> list[tuple[int, int]]:
    """(rank, first row in the concatenation) of every other rank's segment: [local rows ++ r != own]."""
    return [(r, local + i * width) for i, r in enumerate(r for r in range(world) if r != own)]


class _ConcatOthers(torch.autograd.Function):
    """[local K ++ the other ranks' segments] (and V) from the gathered buffer; backward puts the segments'
    gradients in the buffer's layout, the own segment zero (its rows are the local ones)."""

    @staticmethod
    def forward(ctx, k, v, gathered, world: int, own: int):
        seg = gathered.view(world, 2, *gathered.shape[1:])  # [world, 2, B, Hk, width, D]
        local, width = k.shape[2], seg.shape[4]
        total = local + (world - 1) * width
        k_cat = k.new_empty(k.shape[:2] + (total,) + k.shape[3:])
        v_cat = v.new_empty(v.shape[:2] + (total,) + v.shape[3:])
        k_cat[:, :, :local], v_cat[:, :, :local] = k, v
        for r, lo in _other_slots(world, own, local, width):
            k_cat[:, :, lo : lo + width], v_cat[:, :, lo : lo + width] = seg[r, 0], seg[r, 1]
        ctx.world, ctx.own, ctx.local, ctx.shape = world, own, local, gathered.shape
        return k_cat, v_cat

    @staticmethod
    def backward(ctx, dk_cat, dv_cat):
        world, own, local = ctx.world, ctx.own, ctx.local
        ref = dk_cat if dk_cat is not None else dv_cat
        grads = [g if g is not None else torch.zeros_like(ref) for g in (dk_cat, dv_cat)]
        d_gathered = ref.new_empty(ctx.shape)
        seg = d_gathered.view(world, 2, *ctx.shape[1:])
        width = seg.shape[4]
        seg[own].zero_()
        for r, lo in _other_slots(world, own, local, width):
            seg[r, 0], seg[r, 1] = grads[0][:, :, lo : lo + width], grads[1][:, :, lo : lo + width]
        return grads[0][:, :, :local], grads[1][:, :, :local], d_gathered, None, None


class GatherHandle:
    """One in-flight gather: `concat()` or `segments()` wait for it and return the gathered K and V;
    `regather_saved()` optionally frees them after forward (backward gathers them again from the small local
    shard, once per call)."""

    def __init__(self, gathered: torch.Tensor, shard: torch.Tensor, pending: _Pending):
        self._gathered: torch.Tensor | None = gathered
        self._shard, self._pending = shard, pending
        self._storage = None

    def _wait(self) -> torch.Tensor:
        assert self._gathered is not None, "a GatherHandle is waited for once (concat() or segments())"
        kv = _Wait.apply(self._gathered, self._pending)  # [world * 2, B, Hk, width, D], rank-major
        self._gathered = None  # the handle must not keep the big buffer alive
        return kv

    def concat(self, k: torch.Tensor, v: torch.Tensor, own: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait, then K and V over [k ++ every segment but `own`]. The gathered buffer is not saved for
        backward (only its shape is)."""
        return _ConcatOthers.apply(k, v, self._wait(), self._pending.world, own)

    def segments(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Wait, then every rank's (K, V), each [B, Hk, width, D], as views of the gathered buffer."""
        kv = self._wait()
        self._storage = kv.untyped_storage().data_ptr()
        # unbind, not indexing: its backward stacks the segments' gradients once (indexing would build a
        # zero-filled gradient of the whole buffer per view)
        ranks = kv.view(self._pending.world, 2, *kv.shape[1:]).unbind(0)
        return [tuple(r.unbind(0)) for r in ranks]

    def _gather_again(self) -> torch.Tensor:
        p, shard = self._pending, self._shard
        out = shard.new_empty((p.world * shard.shape[0],) + tuple(shard.shape[1:]))
        dist.all_gather_into_tensor(out, shard, group=p.group)
        p.stats.add("all_gather_backward" + p.label, shard.numel() * shard.element_size() * (p.world - 1))
        return out

    @contextlib.contextmanager
    def regather_saved(self) -> Iterator[None]:
        """Tensors saved for backward inside this block that view the gathered buffer are not kept: backward
        gathers the buffer again (one extra all-gather of the shard per call, not overlapped) and rebuilds
        each view with its original size, stride and offset. Trades one collective for world x shard memory."""
        storage, regathered = self._storage, {}

        def pack(t: torch.Tensor):
            if storage is not None and t.untyped_storage().data_ptr() == storage:
                return (_REGATHER, t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(packed):
            if isinstance(packed, tuple) and packed and packed[0] is _REGATHER:
                if "buffer" not in regathered:
                    regathered["buffer"] = self._gather_again()
                return regathered["buffer"].as_strided(packed[1], packed[2], packed[3])
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


_REGATHER = object()


def all_gather_rows(
    t: torch.Tensor, group=None, *, stats: CommStats = COMM_STATS, label: str = ""
) -> torch.Tensor:
    """Every rank's `t` stacked rank-major: [world, *t.shape]; backward reduce-scatters the gradient
    (synchronous use of the same start/wait pair KVGather overlaps with compute)."""
    pending = _Pending(group, dist.get_world_size(group), stats, label)
    gathered = _Wait.apply(_Start.apply(t.contiguous(), pending), pending)
    return gathered.view(pending.world, *t.shape)


class KVGather:
    """Gathers the shared rows of local K and V from every rank of `group`.

    `start(k, v, rows, width)` launches the collective and returns a `GatherHandle` at once; its `concat()`
    or `segments()` wait and return the gathered K and V (segment r = rank r's rows, padded to `width`).
    `rows` should already be on k's device (ShardedAttention stages its plan's rows once, ahead of the
    step): an index elsewhere costs a host-to-device copy per call.
    """

    def __init__(self, group=None, *, stats: CommStats = COMM_STATS):
        self.group = group
        self.world = dist.get_world_size(group)
        self.stats = stats

    def start(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | slice, width: int) -> GatherHandle:
        """`rows`: the local rows to share - an index, or a slice when they are a run (no index kernels)."""
        if isinstance(rows, slice):
            kv = torch.stack([k[:, :, rows], v[:, :, rows]], dim=0)  # [2, B, Hk, n, D]
        else:
            if rows.device != k.device:  # one copy for K and V (a caller that staged its rows makes none)
                rows = rows.to(k.device)
            kv = torch.stack([k.index_select(2, rows), v.index_select(2, rows)], dim=0)
        n = kv.shape[3]
        if n < width:
            kv = torch.cat([kv, kv.new_zeros(kv.shape[:3] + (width - n,) + kv.shape[4:])], dim=3)
        shard = kv  # [2, B, Hk, width, D]: this rank's segment of the buffer
        pending = _Pending(self.group, self.world, self.stats)
        return GatherHandle(_Start.apply(shard, pending), shard.detach(), pending)
