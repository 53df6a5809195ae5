"""The generic training loop and its launcher.

launch(entry, parallel, ...)      torchrun (NCCL, one GPU per rank) or P self-spawned gloo ranks (CPU)
  train(workload, train, parallel)
    context (dp x cp mesh) -> seed -> model (broadcast from rank 0) -> [activation checkpointing]
    AdamW + warmup/cosine -> resume from output_dir/latest
    per step: train_step -> one log line (loss, lr, grad norm, tokens/s, MFU, peak memory)
    checkpoints every save_every steps and at the end (atomic)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..distributed.launch import init_from_env, spawn
from .checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from .context import TrainContext, build_context
from .metrics import format_step, max_over_ranks, peak_device_tflops, peak_memory_gib, reset_peak_memory
from .schedule import build_scheduler
from .step import train_step
from .workload import Workload, load_model, save_model

if TYPE_CHECKING:
    from .config import ParallelConfig, TrainConfig

__all__ = ["launch", "train", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch(entry: Callable[..., Any], parallel: ParallelConfig, *args: Any) -> None:
    """Run entry(rank, world_size, *args) on every rank: join torchrun, or spawn parallel.world_size gloo
    ranks on this machine. Degrees are checked before any process starts."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        parallel.degrees(world)
        rank, world = init_from_env()
        try:
            entry(rank, world, *args)
        finally:
            dist.destroy_process_group()
    else:
        parallel.degrees(parallel.world_size)
        spawn(entry, parallel.world_size, *args, timeout_s=1800.0)


def _broadcast_parameters(model: torch.nn.Module) -> None:
    """Make every replica start from rank 0's weights (and buffers)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def _build(workload: Workload, ctx: TrainContext, train: TrainConfig):
    torch.manual_seed(train.seed)
    model = workload.build_model(ctx).to(device=ctx.device, dtype=ctx.param_dtype)
    _broadcast_parameters(model)
    if train.activation_checkpointing:
        enable = getattr(model, "enable_activation_checkpointing", None)
        if enable is None:
            raise ValueError(
                f"train.activation_checkpointing: {type(model).__name__} has no "
                f"enable_activation_checkpointing()"
            )
        enable()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    on_gpu = ctx.device.type == "cuda"
    if on_gpu:  # fp32 matmuls (e.g. the loss's weight gradient) on tensor cores
        torch.set_float32_matmul_precision("high")
    optimizer = torch.optim.AdamW(
        params, lr=train.lr, betas=train.betas, eps=train.adam_eps, weight_decay=train.weight_decay,
        fused=on_gpu or None,
    )  # fmt: skip
    scheduler = build_scheduler(
        optimizer, warmup_steps=train.warmup_steps, total_steps=train.steps, min_ratio=train.min_lr_ratio
    )
    return model, optimizer, scheduler


def train(
    workload: Workload, train: TrainConfig, parallel: ParallelConfig, *, recipe: dict | None = None
) -> list[dict]:
    """Train on an initialised process group; returns the per-step metrics (identical on every rank)."""
    ctx = build_context(train, parallel)
    model, optimizer, scheduler = _build(workload, ctx, train)
    start = 0
    resume_from = latest_checkpoint(train.output_dir) if train.resume else None
    if resume_from is not None:
        load_model(workload, model, resume_from)
        state = torch.load(resume_from / "optimizer.pt", map_location=ctx.device)
        optimizer.load_state_dict(state["optimizer"])  # restores the lr of step `start` too
        scheduler.load_state_dict(state["scheduler"])
        start = int(load_trainer_state(resume_from)["step"])
    tokens = workload.tokens_per_step(ctx)
    flops = workload.flops_per_step(ctx)
    peak = peak_device_tflops(ctx.device, train.peak_tflops)
    history: list[dict] = []
    bar = tqdm(total=train.steps, initial=start, disable=not (ctx.is_main and train.progress), desc="train")
    log_file = None
    if ctx.is_main and train.output_dir is not None:
        Path(train.output_dir).mkdir(parents=True, exist_ok=True)
        log_file = open(Path(train.output_dir) / "log.jsonl", "a")
    try:
        for step in range(start, train.steps):
            reset_peak_memory(ctx.device)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            result = train_step(model, optimizer, workload, ctx, step, grad_clip=train.grad_clip)
            scheduler.step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            seconds = max_over_ranks(
                time.perf_counter() - t0, ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
            )
            metrics = {
                "step": step + 1,
                "loss": result.loss,
                "lr": lr,
                "grad_norm": result.grad_norm,
                "denominator": result.denominator,
                "step_s": seconds,
                "tokens_per_s": tokens / seconds,
                "mfu": None
                if flops is None or peak is None
                else flops / seconds / (ctx.world_size * peak * 1e12),
                "peak_mem_gib": max_over_ranks(peak_memory_gib(ctx.device), ctx.device),
            }
            history.append(metrics)
            if ctx.is_main:
                bar.update(1)
                if (step + 1) % train.log_every == 0 or step + 1 == train.steps:
                    line = format_step(step + 1, train.steps, metrics)
                    bar.write(line) if train.progress else print(line, flush=True)
                if log_file is not None:
                    log_file.write(json.dumps(metrics) + "\n")
                    log_file.flush()
            last = step + 1 == train.steps
            if train.output_dir is not None and (
                last or (train.save_every and (step + 1) % train.save_every == 0)
            ):
                if ctx.is_main:
                    save_checkpoint(
                        train.output_dir,
                        step + 1,
                        write_model=lambda p: save_model(workload, model, p),
                        optimizer_state={
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                        },
                        trainer_state={"step": step + 1, "recipe": recipe or {}},
                        keep=train.keep_checkpoints,
                    )
                dist.barrier()
    finally:
        bar.close()
        if log_file is not None:
            log_file.close()
    return history
