"""One optimizer step: global denominator, micro-batch backward, summed gradients, clipping, AdamW.

    denominator all-reduce -> per micro batch: forward, backward (no host sync: the numerators stay on
    the device) -> losses and local gradients checked finite -> ranks agree (OOM? non-finite?) -> gradient all-reduce -> clip
    (global norm checked finite) -> AdamW

A failure is raised on every rank of the group before the optimizer step, so weights, optimizer state,
schedule and checkpoints stay those of the last good step; the message names the first offending rank
and tensor (`NonFiniteError`, `StepOutOfMemory`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.launch import heartbeat
from ..errors import RunFault, allocation_size
from .context import TrainContext
from .validate import first_nonfinite
from .workload import Workload

__all__ = [
    "NonFiniteError",
    "StepOutOfMemory",
    "StepResult",
    "first_offender",
    "global_denominator",
    "out_of_memory",
    "reduce_gradients",
    "train_step",
]  # fmt: skip

_BUCKET_BYTES = 256 << 20


@dataclass
class StepResult:
    loss: float  # global loss (numerators summed over the job / global denominator)
    denominator: float
    grad_norm: float


def global_denominator(batches, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of every rank's denominators (float64, CPU-exact), all-reduced before any backward."""
    local = torch.tensor([sum(float(b.denominator) for b in batches)], dtype=torch.float64)
    if dist.is_initialized():
        local = local.to(_collective_device(group))
        dist.all_reduce(local, group=group)
    return local.cpu()[0]


def _collective_device(group) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum gradients over `group` in flat buckets (missing grads count as zeros)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        key = (p.grad.dtype, p.grad.device)
        if not buckets or size + p.grad.numel() * p.grad.element_size() > _BUCKET_BYTES or key != (
            buckets[-1][0].dtype, buckets[-1][0].device,
        ):  # fmt: skip
            buckets.append([])
            size = 0
        buckets[-1].append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
    for grads in buckets:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


class StepOutOfMemory(RunFault):
    """Some rank ran out of device memory in forward/backward; raised on every rank of the group, naming the
    ranks and what each had allocated (the trainer adds what to change)."""


class NonFiniteError(RunFault):
    """A NaN/Inf loss or gradient on some rank; raised on every rank of the group, before the optimizer step."""


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _any_rank(flags: list[bool], group) -> list[bool]:
    """Element-wise OR of `flags` over the group (one all-reduce)."""
    t = torch.tensor([float(f) for f in flags])
    if dist.is_initialized():
        t = t.to(_collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.cpu().tolist()]


def _oom_detail(err: BaseException, device: torch.device | None) -> str:
    """What this rank had when the allocation failed, e.g. 'tried to allocate 2.00 GiB; peak 130.1 GiB
    allocated of 139.8 GiB' (torch's message and the CUDA allocator; parts it cannot know are left out)."""
    tried = allocation_size(err)
    parts = [f"tried to allocate {tried}"] if tried else []
    if device is not None and device.type == "cuda":
        with contextlib.suppress(RuntimeError):
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            total = torch.cuda.mem_get_info(device)[1] / 2**30
            parts.append(f"peak {peak:.1f} GiB allocated of {total:.1f} GiB")
    return "; ".join(parts)


def out_of_memory(step: int, local: str | None, group) -> str:
    """'step N: device out of memory on rank r (tried to allocate ...)' from every rank's finding (None:
    this rank did not run out); all ranks of `group` call it once they agreed that some rank ran out."""
    found: list[str | None] = [local]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, local, group=group)
    ranks = [r for r, f in enumerate(found) if f is not None]
    names = {
        r: dist.get_global_rank(group, r) if group is not None and dist.is_initialized() else r for r in ranks
    }
    where = "; ".join(f"rank {names[r]}" + (f" ({found[r]})" if found[r] else "") for r in ranks[:4])
    more = f"; {len(ranks) - 4} more rank(s)" if len(ranks) > 4 else ""
    return f"step {step + 1}: device out of memory on {where}{more}"


def first_offender(step: int, local: tuple[int, str] | None, group) -> str:
    """'step N: non-finite value on rank r: first offending tensor ...' from every rank's local finding
    (phase, text): a loss (phase 0) comes before a gradient (phase 1), since a NaN reaching the loss on one
    rank also poisons other ranks' gradients through the attention collectives' backward; then the lowest
    rank."""
    found: list[tuple[int, str] | None] = [local]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, local, group=group)
    ranks = [r for r, f in enumerate(found) if f is not None]
    order = sorted(ranks, key=lambda r: (found[r][0], r))
    names = {
        r: dist.get_global_rank(group, r) if group is not None and dist.is_initialized() else r for r in ranks
    }
    others = [names[r] for r in order[1:]]
    also = f" (also on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return (
        f"step {step + 1}: non-finite value on rank {names[order[0]]}{also}: first offending tensor "
        f"{found[order[0]][1]}; the step was not applied (weights, optimizer state and checkpoints are those "
        f"of step {step})"
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    workload: Workload,
    ctx: TrainContext,
    step: int,
    *,
    grad_clip: float | None,
    group: dist.ProcessGroup | None = None,
    span: Callable[[str], AbstractContextManager] | None = None,
) -> StepResult:
    """One optimizer step over `group` (default: the world). Ranks agree on a device OOM and on non-finite
    losses / gradients before the gradient reduction, so a failure on one rank fails the step everywhere
    (instead of hanging) and nothing is applied. `span(name)` (benchmarks) times the gradient reduction."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    batches = workload.microbatches(ctx, step)
    heartbeat(f"step {step + 1}: loss denominator")
    denom = global_denominator(batches, group)
    scale = denom.clamp_min(1.0)  # a step with nothing supervised contributes zero, not NaN
    total = torch.zeros((), dtype=torch.float64)
    oom, bad = None, None
    numerators: list[torch.Tensor] = []  # on the device: read once after the last backward (one host sync)
    try:
        for i, batch in enumerate(batches):
            heartbeat(f"step {step + 1}: micro batch {i} forward/backward")
            with ctx.autocast():
                numerator = workload.loss_numerator(model, batch, ctx)
            # backward even when non-finite: the other ranks' backward collectives need this rank's part
            (numerator / scale.to(numerator.dtype)).backward()
            numerators.append(numerator.detach().double())
    except _OOM as err:
        oom = _oom_detail(err, getattr(ctx, "device", None))
        numerator = None  # the failed micro batch's graph (its saved activations): free it before a retry
    values = torch.stack(numerators).cpu() if numerators else torch.zeros(0, dtype=torch.float64)
    for i, value in enumerate(values):  # summed in micro-batch order, as before: the same float64 total
        total += value
        if bad is None and not torch.isfinite(value):
            bad = (0, f"loss numerator of micro batch {i} ({float(value)})")
    if bad is None and oom is None:  # this rank's own gradients, before the sum mixes every rank's in
        grad = first_nonfinite((f"{n}.grad", p.grad) for n, p in named)
        bad = None if grad is None else (1, grad)
    heartbeat(f"step {step + 1}: agree on OOM / non-finite")
    any_oom, any_bad = _any_rank([oom is not None, bad is not None], group)
    if any_oom:
        optimizer.zero_grad(set_to_none=True)
        raise StepOutOfMemory(out_of_memory(step, oom, group))
    if any_bad:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(first_offender(step, bad, group))
    heartbeat(f"step {step + 1}: gradient all-reduce")
    with span("grad_reduce") if span is not None else nullcontext():
        reduce_gradients(params, group)
    loss = total.clone()
    if dist.is_initialized():
        loss = loss.to(_collective_device(group))
        dist.all_reduce(loss, group=group)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else float("inf"))
    if not torch.isfinite(norm):  # finite on every rank, yet the sum overflows
        where = first_nonfinite((f"{n}.grad", p.grad) for n, p in named) or "the norm itself"
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"step {step + 1}: the global gradient norm is {float(norm)} after summing over ranks (overflow); "
            f"first offending tensor {where}; the step was not applied"
        )
    heartbeat(f"step {step + 1}: optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(float(loss.cpu()) / float(scale), float(denom), float(norm))
