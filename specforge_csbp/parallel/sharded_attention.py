"""Run one rank's `ShardPlan` through the seam: local keys now, shared keys after the all-gather.

schedule "fused" (default):

    shared K/V rows ──► all-gather ──► seam(q, [local K/V ++ the other ranks' gathered K/V])

    one kernel and no merge, the shape PyTorch's own context parallel uses. Over NVLink the all-gather it
    waits for is a small part of a layer step, and one kernel over all keys beats P kernels and P - 1
    merges (docs/performance.md has the measurements).

schedule "overlap":

    q_local ──► seam(q, local K/V)  ──────────────┐   (overlaps the all-gather)
    shared K/V rows ──► all-gather (async) ──► seam(q, segment r) for every other rank r ──► LSE merges

    hides the all-gather behind the local call (for slow links) at the price of P kernels and P - 1 merges;
    each remote call reads one rank's segment of the gathered buffer in place (no concatenation). It is the
    only schedule that can `regather` (free the gathered K/V after forward, gather again in backward): the
    fused call saves the concatenation. schedule=None picks "fused", or "overlap" when regather is asked
    for.

Gather ahead (`begin`): a caller that has the leading K/V rows early (a drafter's context K/V depend on the
target features only, not on the layer below) starts the gather before it has the queries and hands the
handle to the call, so the collective runs behind whatever the caller does in between (models/dflash:
the previous layer):

    begin(k_ctx, v_ctx) ──► all-gather ......................► __call__(q, k, v, gathered=handle)
                            (the layer before runs meanwhile)

The local call sees every key this rank holds; the remote calls see the other ranks' shared keys (this
rank's own segment is never attended to: its rows are the local ones). Reference, CP, BP and CSBP are this
same code over different plans (layout/plans.py).

Index staging: the plan's shared rows (which local K/V rows go into the all-gather) are copied to the device
once per executor, by `prepare` (ahead of the step, on the prefetch worker's side stream) or at the first
call, never per call: a layer runs it in forward and again in any recompute (`devices.stage_index`: pinned
memory, non_blocking, so the host never waits for the GPU queue). Rows that are a run of the first local rows
(full layers share every context row) are a slice: nothing to stage, no index kernels.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..attention import merge_partials, partial_attention, prepare_attention
from ..devices import device_key, stage_index
from ..distributed.collectives import GatherHandle, KVGather
from ..layout.plans import ShardPlan, bdlm_plan
from ..layout.tokens import TokenSet
from ..masks.visibility import Visibility
from .options import SCHEDULES, AttentionOptions, resolve_schedule

__all__ = ["SCHEDULES", "ShardedAttention", "bdlm_attention", "resolve_schedule"]

_DEFAULTS = AttentionOptions()


class ShardedAttention:
    """Attention of this rank's query rows over all keys visible to them, wherever they live."""

    def __init__(
        self,
        plan: ShardPlan,
        block_size: int,
        *,
        clean_within_block: str = "causal",
        window: int | None = None,
        noisy_causal: bool = False,
        group: dist.ProcessGroup | None = None,
        options: AttentionOptions = _DEFAULTS,
    ):
        """`options`: backend, schedule, regather, GQA packing and byte counter (parallel/options.py); the
        rest says which rule this executor runs (window, in-block causality) over which group."""
        schedule = options.resolved_schedule
        if plan.world_size > 1:
            group_size = dist.get_world_size(group)
            if group_size != plan.world_size:
                raise ValueError(f"world_size: plan has {plan.world_size} ranks, process group has {group_size}")
        self.plan, self.group, self.options, self.schedule = plan, group, options, schedule
        self.block_size, self.window = block_size, window
        # everything but the window, for `windowed` siblings (sliding-window layers of the same model)
        self._settings = {"clean_within_block": clean_within_block, "noisy_causal": noisy_causal, "group": group,
                          "options": options}  # fmt: skip
        self._windowed: dict[int, ShardedAttention] = {}
        self.regather = options.regather  # free gathered K/V after forward; gather again in backward
        self.seam = {"backend": options.backend, "pack_gqa": options.pack_gqa}  # pack_gqa None: the seam decides
        rule = dict(clean_within_block=clean_within_block, window=window, noisy_causal=noisy_causal)
        self.local = Visibility(plan.q_tokens, plan.kv_tokens, block_size, **rule)
        self._gather = KVGather(group, stats=options.stats) if plan.communicates else None
        self._shared_on: dict[torch.device, torch.Tensor] = {}  # plan.shared per device (`shared_rows`)
        # shared rows that are the first rows in order (full layers share every context row) are a slice:
        # no index to stage, no index_select forward or index_add backward
        self._shared_run = slice(0, len(plan.shared)) if plan.communicates and plan.shares_leading_rows else None
        # rows `begin` needs at least: every shared row lies in them
        self._shared_end = int(plan.shared.max()) + 1 if plan.communicates and len(plan.shared) else 0
        if plan.communicates and schedule == "fused":  # one call over [local ++ the other ranks' segments]
            # the own segment of the gathered buffer is all PAD, so the kernel never gets it: 1/P fewer key
            # rows to copy, mask and write zero gradients for
            self.fused = Visibility(
                plan.q_tokens, TokenSet.cat([plan.kv_tokens, plan.other_kv_tokens]), block_size, **rule
            )
        elif plan.communicates:  # one call per other rank's segment of the gathered keys, merged with the local one
            self.remote = {
                r: Visibility(plan.q_tokens, plan.segment_tokens(r), block_size, **rule)
                for r in range(plan.world_size) if r != plan.rank
            }  # fmt: skip

    def windowed(self, window: int) -> ShardedAttention:
        """This executor with a sliding window of `window` clean keys (cached): the same plan, gather and
        settings, the visibility rule's window on top (a model's sliding-window layers). It gathers the
        same clean K/V as the full executor and masks the keys outside the window."""
        if window not in self._windowed:
            self._windowed[window] = ShardedAttention(
                self.plan, self.block_size, window=window, **self._settings
            )
        return self._windowed[window]

    @property
    def visibilities(self) -> tuple[Visibility, ...]:
        """The visibilities this schedule's seam calls run with (fused never calls the local-only one)."""
        if self._gather is None:
            return (self.local,)
        return (self.fused,) if self.schedule == "fused" else (self.local, *self.remote.values())

    def prepare(self, device: torch.device | str, groups: int) -> None:
        """Build every mask the seam calls will need (tables, packing decision, block masks) and stage the
        gather's rows on `device` now, for query heads per kv head `groups`, instead of inside the first
        forward call."""
        for vis in self.visibilities:
            prepare_attention(vis, groups=groups, device=device, **self.seam)
        if self._gather is not None:
            self.shared_rows(device)

    def shared_rows(self, device: torch.device | str) -> torch.Tensor | slice:
        """The plan's shared rows on `device`: staged by `prepare`, else copied at the first call (once); a
        slice when they are the first rows in order."""
        if self._shared_run is not None:
            return self._shared_run
        device = device_key(device)
        rows = self._shared_on.get(device)
        if rows is None:
            rows = self._shared_on[device] = stage_index(self.plan.shared, device)
        return rows

    def begin(self, k_lead: torch.Tensor, v_lead: torch.Tensor) -> GatherHandle | None:
        """Start the gather from the leading rows of this call's K/V (every shared row must lie in them),
        for a later `__call__(..., gathered=handle)` over K/V that begin with these rows; None when this
        plan gathers nothing."""
        if self._gather is None:
            return None
        if k_lead.shape[2] < self._shared_end:
            raise ValueError(
                f"begin: the shared rows reach row {self._shared_end - 1}, but only {k_lead.shape[2]} leading "
                "K/V rows were given"
            )
        return self._gather.start(k_lead, v_lead, self.shared_rows(k_lead.device), self.plan.gather_len)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        gathered: GatherHandle | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gathered`: the handle `begin` returned for K/V whose leading rows these k / v begin with."""
        if self._gather is None:
            if gathered is not None:
                raise ValueError("gathered: this plan gathers nothing (begin returned None)")
            return partial_attention(q, k, v, self.local, scale=scale, **self.seam)
        if gathered is None:
            gathered = self._gather.start(k, v, self.shared_rows(k.device), self.plan.gather_len)
        handle = gathered
        if self.schedule == "fused":
            # [local ++ the other ranks' segments] copied into one K and one V, so the gathered buffer itself
            # is not saved for backward (the concatenation is); the own segment (all PAD) is left out and its
            # gradient is zero
            k_cat, v_cat = handle.concat(k, v, self.plan.rank)
            return partial_attention(q, k_cat, v_cat, self.fused, scale=scale, **self.seam)
        out, lse = partial_attention(q, k, v, self.local, scale=scale, **self.seam)
        segments = handle.segments()  # views of the gathered buffer: attended to in place, no copy
        with handle.regather_saved() if self.regather else contextlib.nullcontext():
            for r, vis in self.remote.items():
                out_r, lse_r = partial_attention(q, *segments[r], vis, scale=scale, **self.seam)
                out, lse = merge_partials(out, lse, out_r, lse_r)
        return out, lse


def bdlm_attention(
    mode: str,
    seq_len: int,
    block_size: int,
    *,
    group: dist.ProcessGroup | None = None,
    clean_within_block: str = "causal",
    options: AttentionOptions = _DEFAULTS,
) -> ShardedAttention:
    """This rank's attention for a BDLM sequence (`plan.q_rows` says which 2L rows it holds)."""
    world = dist.get_world_size(group) if mode != "reference" and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    plan = bdlm_plan(mode, seq_len, block_size, world)[rank]
    return ShardedAttention(
        plan, block_size, clean_within_block=clean_within_block, group=group, options=options
    )
