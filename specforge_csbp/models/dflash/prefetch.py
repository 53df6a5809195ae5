"""Build the next drafter step (plans, attention executors, their masks, its device indices) while this step
runs on the GPU.

Every drafter step draws new anchors, so every step has new plans and new block masks. Built inside the
forward pass, that work (CPU tables, tile counting, the GQA packing decision, host-to-device copies) stops
the GPU at each of its host syncs, which idles the GPU for as long as the build takes (the drafter
benchmark records it as `prep_ms`; docs/performance.md). Here a worker thread
builds step i+1 on a side CUDA stream while step i runs; its syncs wait for the side stream only.

    main thread, main stream:  | step i: forward ....... backward ....... metrics (sync) | step i+1 ...
    worker, side stream:         | build i+1: plans, executors, masks, indices | record ready -^ wait ready

Every integer index the step reads is staged there too, so the step moves none to the device: a copy from
pageable memory stops the host until the GPU queue drains (benchmarks/profile_train.py shows them in a
trace). Two owners, one
copy each, pinned and non_blocking (`stage_index`):
  - `ShardedAttention.prepare` stages its plan's gather rows (which local K/V rows are all-gathered);
  - `stage_indices` stages the work item's own: draft rows' positions and token ids, context positions,
    sliding layers' context rows, the loss's supervised rows / targets / predecessors (`StagedIndices`).
A step nobody prepared stages the same indices itself, once each, at the point of first use.

Lifetime: a prepared step's masks and staged indices are allocated on the side stream and read on the main
one, so when they are freed the allocator hands their memory back to the side stream at once. Two rules keep
a later build from overwriting it while main-stream kernels still read it:
  - every build first makes the side stream wait (on the GPU, not the host) for the main-stream work queued
    before the build was submitted;
  - the caller keeps a PreparedStep referenced until every kernel that reads its masks has been launched
    (its step's backward included); freeing it while a build submitted before those launches still runs
    needs a sync first (those kernels done).
StepPrefetcher enforces the first (`_build`). A loop over drafter_step keeps the second: the step ends with a
sync for its metrics before its PreparedStep goes. The plugin's `PrefetchJobs` (plugin/prefetch_jobs.py)
enforces it across micro-steps: it holds a micro-step's PreparedSteps until the next one starts and drops
them only after the look-ahead's build has finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Self

import torch
import torch.distributed as dist

from ...devices import device_key, stage_index
from ...objectives.dflash import BlockTargets, LossIndex, loss_index
from ...parallel.options import AttentionOptions
from .features import load_context
from .layer_attention import LayerAttention
from .sharding import DrafterPlan, plan_attention, prepare_plan_attention

__all__ = ["FeatureLoad", "PreparedStep", "StagedIndices", "StepPrefetcher", "build_work", "stage_indices"]


@dataclass(frozen=True)
class FeatureLoad:
    """Load each work item's context features ahead too (`load_context`), as `dtype` rows of `width`: a
    host-resident store is read into pinned memory by the worker and copied on its side stream, so the
    step neither reads the store nor waits for a pageable copy. Costs one more step's features on the
    device while the current step runs (at 512K, 5 target layers x 5120, bf16: 13.4 GB per rank)."""

    dtype: torch.dtype
    width: int


@dataclass(frozen=True)
class StagedIndices:
    """The integer indices of one work item (sample, plan, block targets) on the step's device.

        draft rows   block b, slot k:  position_ids = anchor_b + k     draft_ids = [anchor token, MASK ...]
        context      context_position_ids (RoPE of the rank's context rows); ctx_index per layer type
                     (the context rows feeding a sliding layer's K/V; None: all rows)
        loss         LossIndex: supervised rows, their targets and predecessors, the supervised mask
    """

    position_ids: torch.Tensor  # [N*S]
    draft_ids: torch.Tensor  # [N*S]
    context_position_ids: torch.Tensor  # [Nc]
    ctx_index: Mapping[str, torch.Tensor | None]
    loss: LossIndex

    def with_context_rows(self, attention: Mapping[str, LayerAttention]) -> dict[str, LayerAttention]:
        """The model's `attention` argument with each layer type's context rows taken from here."""
        return {kind: dataclasses.replace(layer, ctx_index=self.ctx_index[kind]) for kind, layer in attention.items()}


def stage_indices(plan: DrafterPlan, blocks: BlockTargets, device: torch.device | str) -> StagedIndices:
    """Copy one work item's indices to `device` (on the current stream: the worker's side stream when
    prefetched); computed on the host first, so nothing here waits for the GPU."""
    S = plan.block_size
    put = functools.partial(stage_index, device=device)
    return StagedIndices(
        position_ids=put((blocks.anchors[:, None] + torch.arange(S)).reshape(-1)),
        draft_ids=put(blocks.draft_ids.reshape(-1)),
        context_position_ids=put(plan.ctx_positions),
        ctx_index={k: None if lp.ctx_index is None else put(lp.ctx_index) for k, lp in plan.layers.items()},
        loss=loss_index(blocks).to(device),
    )


def build_work(
    work: list,
    options: AttentionOptions,
    device: torch.device | str,
    groups: int,
    features: FeatureLoad | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[dict[str, LayerAttention]], list[StagedIndices], list[list[torch.Tensor]]]:
    """Per work item (sample, plan, block targets): its attention over `group` with every mask built, its
    indices staged on `device` (on the current stream), for `groups` query heads per kv head, and with
    `features` its context features loaded (else an empty list)."""
    attention, indices, loaded = [], [], []
    for sample, plan, blocks in work:
        staged = stage_indices(plan, blocks, device)
        layer_attention = staged.with_context_rows(plan_attention(plan, group=group, options=options))
        prepare_plan_attention(layer_attention, device, groups)  # masks and gather rows
        attention.append(layer_attention)
        indices.append(staged)
        if features is not None:
            pin = torch.device(device).type == "cuda"
            loaded.append(load_context(sample, plan.ctx_intervals, device, features.dtype, features.width, pin=pin))
    return attention, indices, loaded


@dataclass
class PreparedStep:
    """One step's work items (sample, plan, block targets) and, per item, its attention with masks built
    and its indices staged on the device (both empty: not built ahead)."""

    work: list
    options: AttentionOptions
    attention: list[Mapping[str, LayerAttention]]
    ready: torch.cuda.Event | None = None  # recorded on the side stream after the last mask and copy
    indices: list[StagedIndices] = field(default_factory=list)
    features: list[list[torch.Tensor]] = field(default_factory=list)  # per item, when a FeatureLoad asked
    group: dist.ProcessGroup | None = None  # the process group its executors gather over

    def check_for(self, options: AttentionOptions, group: dist.ProcessGroup | None) -> None:
        """One-line error when a step asks for other options or another group than this was built for."""
        if self.options != options:
            raise ValueError(f"prepared: built with {self.options}, but this step asks for {options}")
        if self.group is not group:
            raise ValueError("prepared: built for another process group than this step's")

    def wait(self) -> None:
        """Make the current stream wait for the masks and indices (on the GPU: the host does not block)."""
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)


class StepPrefetcher:
    """`take(i)` returns step i prepared and starts preparing step i + 1 in the worker.

    `prepare(i)` is the step's device-free part (`prepare_step`); `options` and `group` build the executors;
    `groups` is query heads per kv head (for the packed masks); `device` is where the masks live. `masks=False`
    prepares the work items only (the step then builds its attention itself). `features` loads each item's
    context features ahead as well (`FeatureLoad`).
    """

    def __init__(
        self,
        prepare: Callable[[int], list],
        options: AttentionOptions,
        *,
        device: torch.device | str,
        groups: int,
        group: dist.ProcessGroup | None = None,
        masks: bool = True,
        features: FeatureLoad | None = None,
    ) -> None:
        self.prepare, self.options, self.groups, self.masks = prepare, options, int(groups), bool(masks)
        self.group, self.features = group, features
        self.device = device_key(device)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="csbp-prefetch")
        self._pending: dict[int, Future[PreparedStep]] = {}

    def _build(self, step: int, after: torch.cuda.Event | None) -> PreparedStep:
        work = self.prepare(step)
        if not self.masks:
            return PreparedStep(work, self.options, [], group=self.group)
        with contextlib.ExitStack() as gpu:
            if self._side is not None:  # the current device and stream are per thread: set both here
                gpu.enter_context(torch.cuda.device(self.device))
                gpu.enter_context(torch.cuda.stream(self._side))
                self._side.wait_event(after)  # memory freed before the submit may be reused (module doc)
            attention, indices, features = build_work(
                work, self.options, self.device, self.groups, self.features, group=self.group
            )
            ready = self._side.record_event() if self._side is not None else None
        return PreparedStep(work, self.options, attention, ready, indices, features, self.group)

    def submit(self, step: int) -> None:
        if step not in self._pending:
            after = torch.cuda.current_stream(self.device).record_event() if self._side is not None else None
            self._pending[step] = self._pool.submit(self._build, step, after)

    def take(self, step: int) -> PreparedStep:
        self.submit(step)
        prepared = self._pending.pop(step).result()  # re-raises the worker's error here
        for stale in [s for s in self._pending if s < step]:  # steps skipped by the caller
            self._pending.pop(stale).cancel()
        self.submit(step + 1)
        return prepared

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
