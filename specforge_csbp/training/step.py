"""One optimizer step: global denominator, micro-batch backward, summed gradients, clipping, AdamW."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .context import TrainContext
from .workload import Workload

__all__ = ["StepOutOfMemory", "StepResult", "global_denominator", "reduce_gradients", "train_step"]

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


class StepOutOfMemory(RuntimeError):
    """Some rank ran out of device memory in forward/backward; raised on every rank of the group."""


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _any_rank(flag: bool, group) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([float(flag)], device=_collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
    """One optimizer step over `group` (default: the world). Ranks agree on a device OOM before the
    gradient reduction, so one rank running out of memory fails the step everywhere instead of hanging.
    `span(name)` (benchmarks) times the gradient reduction."""
    params = [p for p in model.parameters() if p.requires_grad]
    batches = workload.microbatches(ctx, step)
    denom = global_denominator(batches, group)
    scale = denom.clamp_min(1.0)  # a step with nothing supervised contributes zero, not NaN
    total = torch.zeros((), dtype=torch.float64)
    oom = False
    try:
        for batch in batches:
            with ctx.autocast():
                numerator = workload.loss_numerator(model, batch, ctx)
            (numerator / scale.to(numerator.dtype)).backward()
            total += numerator.detach().double().cpu()
    except _OOM:
        oom = True
    if _any_rank(oom, group):
        optimizer.zero_grad(set_to_none=True)
        raise StepOutOfMemory(f"step {step}: out of device memory on at least one rank")
    with span("grad_reduce") if span is not None else nullcontext():
        reduce_gradients(params, group)
    loss = total.clone()
    if dist.is_initialized():
        loss = loss.to(_collective_device(group))
        dist.all_reduce(loss, group=group)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(float(loss.cpu()) / float(scale), float(denom), float(norm))
