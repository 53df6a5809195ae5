"""Build the next drafter step (plans, attention executors, their masks) while this step runs on the GPU.

Every drafter step draws new anchors, so every step has new plans and new block masks. Built inside the
forward pass, that work (CPU tables, tile counting, the GQA packing decision, host-to-device copies) stops
the GPU at each of its host syncs: on H200 a CSBP step at 512K spent 62 ms of 927 building masks while
the GPU idled (benchmarks/results/drafter_h200x2_2026-11-30.jsonl, `prep_ms`). Here a worker thread
builds step i+1 on a side CUDA stream while step i runs; its syncs wait for the side stream only.

    main thread, main stream:  | step i: forward ....... backward ....... metrics (sync) | step i+1 ...
    worker, side stream:         | build i+1: plans, executors, masks | record ready --------^ wait ready

Lifetime: a prepared step's masks are allocated on the side stream and read on the main one, so when they
are freed the allocator hands their memory back to the side stream at once. Two rules keep a later build
from overwriting it while main-stream kernels still read it:
  - every build first makes the side stream wait (on the GPU, not the host) for the main-stream work queued
    before the build was submitted;
  - the caller keeps a PreparedStep referenced until every kernel that reads its masks has been launched
    (its step's backward included); freeing it while a build submitted before those launches still runs
    needs a sync first (those kernels done).
A loop over drafter_step keeps both: the step ends with a sync for its metrics before its PreparedStep goes.
The plugin (plugin/training_model.py) frees a micro-step's PreparedSteps when the next micro-step starts,
after its backward was launched and with no build running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Self

import torch
import torch.distributed as dist

from ...distributed.collectives import COMM_STATS, CommStats
from .modeling import LayerAttention
from .sharding import DrafterPlan, plan_attention, prepare_plan_attention

__all__ = ["AttentionOptions", "PreparedStep", "StepPrefetcher"]


@dataclass(frozen=True)
class AttentionOptions:
    """How a step's attention executors are built (`plan_attention`'s keywords); a prepared step is only
    used by a step that asks for the same options."""

    group: dist.ProcessGroup | None = None
    backend: str = "auto"
    communicate: bool = True
    stats: CommStats | None = field(default=None, compare=False)  # where bytes are counted (None: COMM_STATS)
    regather: bool = False
    schedule: str | None = None
    pack_gqa: bool | None = None

    def build(self, plan: DrafterPlan) -> dict[str, LayerAttention]:
        return plan_attention(
            plan, group=self.group, backend=self.backend, communicate=self.communicate,
            stats=COMM_STATS if self.stats is None else self.stats,
            regather=self.regather, schedule=self.schedule, pack_gqa=self.pack_gqa,
        )  # fmt: skip


@dataclass
class PreparedStep:
    """One step's work items (sample, plan, block targets) and, per item, its attention with masks built
    (empty: not built ahead)."""

    work: list
    options: AttentionOptions
    attention: list[Mapping[str, LayerAttention]]
    ready: torch.cuda.Event | None = None  # recorded on the side stream after the last mask

    def wait(self) -> None:
        """Make the current stream wait for the masks (a GPU-side wait: the host does not block)."""
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)


class StepPrefetcher:
    """`take(i)` returns step i prepared and starts preparing step i + 1 in the worker.

    `prepare(i)` is the step's device-free part (`prepare_step`); `options` builds the executors; `groups`
    is query heads per kv head (for the packed masks); `device` is where the masks live. `masks=False`
    prepares the work items only (the step then builds its attention itself).
    """

    def __init__(
        self,
        prepare: Callable[[int], list],
        options: AttentionOptions,
        *,
        device: torch.device | str,
        groups: int,
        masks: bool = True,
    ) -> None:
        self.prepare, self.options, self.groups, self.masks = prepare, options, int(groups), bool(masks)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="csbp-prefetch")
        self._pending: dict[int, Future[PreparedStep]] = {}

    def _build(self, step: int, after: torch.cuda.Event | None) -> PreparedStep:
        work = self.prepare(step)
        if not self.masks:
            return PreparedStep(work, self.options, [])
        with contextlib.ExitStack() as gpu:
            if self._side is not None:  # the current device and stream are per thread: set both here
                gpu.enter_context(torch.cuda.device(self.device))
                gpu.enter_context(torch.cuda.stream(self._side))
                self._side.wait_event(after)  # memory freed before the submit may be reused (module doc)
            attention = [self.options.build(plan) for _, plan, _ in work]
            for layer_attention in attention:
                prepare_plan_attention(layer_attention, self.device, self.groups)
            ready = self._side.record_event() if self._side is not None else None
        return PreparedStep(work, self.options, attention, ready)

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
