"""The generic training loop and its launcher.

launch(entry, parallel, ...)      torchrun (NCCL, one GPU per rank), P self-spawned gloo ranks (CPU), or
                                  in this process for one rank; fail-fast on rank faults (distributed/launch.py)
  train(workload, train, parallel)
    context (dp x cp mesh) -> validate output_dir / resume (nothing is written before) -> seed -> model
    (broadcast from rank 0) -> [activation checkpointing: true, or auto = when the step would not fit
    without (checkpointing.py)] -> AdamW + warmup/cosine -> resume from latest
    per step: reseed RNGs from (seed, step) -> train_step (non-finite guard) -> one log line
    checkpoints every save_every steps and at the end (atomic; `latest` replaced last)

Exact resume: everything a step consumes is a function of (seed, step) or is in the checkpoint - weights,
AdamW moments, the scheduler, the step (= the data position, sequence ids are partition-free) - and the
global torch / Python RNGs are reseeded from (seed, step) before every step, so a run resumed from step k
repeats the uninterrupted run's steps k+1... bit for bit (same layout) or to float64 rounding (another
world size, DP degree or CP mode; parameters are replicated, so any layout loads any checkpoint).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..distributed.launch import free_port, heartbeat, init_from_env, spawn
from ..outputs import write_text_atomic
from ..progress import progress_bar
from .checkpoint import load_trainer_state, save_checkpoint
from .checkpointing import (
    CheckpointingChoice,
    available_gib,
    bdlm_peaks,
    keep_activations,
    keep_attention,
    models_memory,
    resolve_attention,
    resolve_checkpointing,
    step_down_scale,
)
from .context import TrainContext, build_context
from .metrics import format_step, max_over_ranks, peak_device_tflops, peak_memory_gib, reset_peak_memory
from .schedule import build_scheduler
from .step import StepOutOfMemory, train_step
from .validate import check_output_dir, check_resume, run_layout
from .workload import Workload, load_model, save_model

if TYPE_CHECKING:
    from .config import ParallelConfig, TrainConfig

__all__ = ["launch", "seed_step", "train", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch(entry: Callable[..., Any], parallel: ParallelConfig, *args: Any) -> None:
    """Run entry(rank, world_size, *args) on every rank: join torchrun, spawn parallel.world_size gloo
    ranks on this machine, or (one rank) run here. Degrees are checked before any process starts; a rank
    that fails or hangs (parallel.timeout_s) stops all of them (`RankFailure` names it)."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        parallel.degrees(world)
        rank, world = init_from_env(timeout_s=parallel.timeout_s)
        try:
            entry(rank, world, *args)
        finally:
            dist.destroy_process_group()
    elif parallel.world_size == 1 and not dist.is_initialized():
        parallel.degrees(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            entry(0, 1, *args)
        finally:
            dist.destroy_process_group()
    else:
        parallel.degrees(parallel.world_size)
        spawn(entry, parallel.world_size, *args, timeout_s=parallel.timeout_s)


def seed_step(seed: int, step: int) -> None:
    """Seed torch (CPU and CUDA) and Python's RNGs from (seed, step): what step `step` draws does not
    depend on what ran before it in this process (so a resumed run draws what the original drew)."""
    digest = hashlib.sha256(f"specforge-csbp:{seed}:{step}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    torch.manual_seed(value)
    random.seed(value)


def _broadcast_parameters(model: torch.nn.Module) -> None:
    """Make every replica start from rank 0's weights (and buffers)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def _compile_scope(setting: bool | str, device: torch.device) -> str | None:
    """train.compile -> what `compile_token_wise` compiles ("layers", "norms"), None for eager."""
    if setting == "auto":
        return "layers" if device.type == "cuda" else None
    if setting is True:
        return "layers"
    return setting or None


def _build(workload: Workload, ctx: TrainContext, train: TrainConfig):
    torch.manual_seed(train.seed)
    model = workload.build_model(ctx).to(device=ctx.device, dtype=ctx.param_dtype)
    _broadcast_parameters(model)
    plan = _apply_checkpointing(model, _checkpointing(train, workload, model, ctx))
    scope = _compile_scope(train.compile, ctx.device)
    if scope is not None:
        compile_token_wise = getattr(model, "compile_token_wise", None)
        if compile_token_wise is None:
            raise ValueError(f"train.compile: {type(model).__name__} has no compile_token_wise(); set it to false")
        compile_token_wise(scope)
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
    return model, optimizer, scheduler, plan


def _apply_checkpointing(model: torch.nn.Module, plan: CheckpointingChoice) -> CheckpointingChoice:
    """Set the model's checkpointing to `plan` (from scratch: applying another plan later replaces it);
    returns the plan with the layers as marked."""
    if not plan.enabled:
        return plan
    enable = getattr(model, "enable_activation_checkpointing", None)
    if enable is None:
        raise ValueError(
            f"train.activation_checkpointing: {type(model).__name__} has no enable_activation_checkpointing()"
        )
    enable()  # every layer checkpointed, then the last keep_layers un-checkpointed
    keep = keep_activations(model, plan.keep_layers)
    return replace(plan, keep_layers=keep, attention_layers=keep_attention(model, plan.attention_layers))


def _checkpointing(
    train: TrainConfig, workload: Workload, model: torch.nn.Module, ctx: TrainContext, scale: float = 1.0
) -> CheckpointingChoice:
    """Checkpointing on?, the layers that keep their activations, and which checkpointed layers keep their
    attention outputs: train.activation_checkpointing / recompute_attention, `auto` decided from the memory
    model (training/checkpointing.py) and the least memory over ranks, so every rank decides the same (a
    recompute re-runs the collectives of what it recomputes: every rank must recompute the same)."""
    if train.activation_checkpointing is False:
        return CheckpointingChoice(False)
    available = None
    if models_memory(ctx):
        available = -max_over_ranks(-available_gib(ctx.device), ctx.device)
    if train.activation_checkpointing is True:
        choice = resolve_attention(workload, model, ctx, train.recompute_attention, available, scale)
        if ctx.is_main and train.recompute_attention == "auto":
            print(f"specforge-csbp: {choice.line('train.recompute_attention')}", flush=True)
        return choice
    choice = resolve_checkpointing(workload, model, ctx, train.recompute_attention, available, scale)
    if ctx.is_main:
        print(f"specforge-csbp: {choice.line()}", flush=True)
    return choice


def _out_of_memory_advice(workload: Workload, model, ctx: TrainContext, train: TrainConfig, recipe: dict,
                          checkpointing: CheckpointingChoice) -> str:  # fmt: skip
    """What a user changes after `StepOutOfMemory`: 'predicted peak 122.8 GiB of 139.8 GiB; set
    train.activation_checkpointing: true (now auto), lower data.max_length (now 32768) or
    objective.ce_chunk_size (now 4096), or add GPUs (parallel.cp_degree, now 1)' - the recipe's own fields
    where it has them; the prediction on GPUs, for workloads with a memory model (training/checkpointing.py)."""
    enabled, keep, attention = checkpointing.enabled, checkpointing.keep_layers, checkpointing.attention_layers
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0
    predicted = ""
    if ctx.device.type == "cuda":
        try:  # the memory model of the layout that ran
            peaks = bdlm_peaks(workload, model, ctx)
            peak = peaks.none if not enabled else peaks.peak(keep, len(attention))
            total = torch.cuda.mem_get_info(ctx.device)[1] / 2**30
            predicted = f"predicted peak {peak:.1f} GiB of {total:.1f} GiB; "
        except Exception:  # noqa: BLE001, S110 - no memory model for this workload: the line goes without it
            pass
    todo = []
    if not enabled:
        now = "auto, which chose off" if train.activation_checkpointing == "auto" else "false"
        todo.append(f"set train.activation_checkpointing: true (now {now})")
    elif keep:
        todo.append(f"set train.activation_checkpointing: true (auto checkpointed {layers - keep} of {layers} layers)")
    if enabled and attention:
        now = f"auto, which kept {len(attention)} layers' outputs" if train.recompute_attention == "auto" else "false"
        todo.append(f"set train.recompute_attention: true (now {now})")
    fields = (("data", "max_length"), ("objective", "ce_chunk_size"))
    lower = [f"{sec}.{name} (now {v})" for sec, name in fields if (v := recipe.get(sec, {}).get(name))]
    if train.micro_batch_size > 1:
        lower.append(f"train.micro_batch_size (now {train.micro_batch_size})")
    if lower:
        todo.append("lower " + (", ".join(lower[:-1]) + " or " if len(lower) > 1 else "") + lower[-1])
    todo.append(f"add GPUs (parallel.cp_degree, now {ctx.cp_size})")
    return predicted + ", ".join(todo[:-1]) + (", or " if len(todo) > 1 else "") + todo[-1]


def _step_down(workload: Workload, model, ctx: TrainContext, train: TrainConfig, failed: CheckpointingChoice,
               scale: float, error: str) -> tuple[float, CheckpointingChoice] | None:  # fmt: skip
    """After a step ran out of memory on some rank (every rank gets here: they agreed on it): when `auto`
    chose the failed setting from the memory model, decide again with its peaks scaled up
    (`step_down_scale`) and apply the new choice - (scale, choice) to retry the step with; None when
    nothing was auto or nothing smaller is left (the run stops with the advice). Every rank computes the
    same: the same failed choice and the least available memory over ranks."""
    auto = train.activation_checkpointing == "auto" or (failed.enabled and train.recompute_attention == "auto")
    if not (auto and models_memory(ctx)):
        return None
    try:
        peaks = bdlm_peaks(workload, model, ctx)
    except ValueError:
        return None
    gc.collect()  # the failed step's tensors
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    available = -max_over_ranks(-available_gib(ctx.device), ctx.device)
    scale = step_down_scale(peaks, failed, available, scale)
    if ctx.is_main:
        print(f"specforge-csbp: {error}; auto decides again with the memory model's peaks x {scale:.2f}", flush=True)
    choice = _checkpointing(train, workload, model, ctx, scale)
    if (choice.enabled, choice.keep_layers, choice.attention_layers) == (
        failed.enabled, failed.keep_layers, failed.attention_layers
    ):
        return None
    return scale, _apply_checkpointing(model, choice)


def _max_over_ranks(seconds: float, peak_gib: float, device: torch.device) -> tuple[float, float]:
    """The step's time and peak memory, each the max over ranks, in one all-reduce (one host sync)."""
    if not dist.is_initialized():
        return seconds, peak_gib
    t = torch.tensor([seconds, peak_gib], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    a, b = t.cpu().tolist()
    return a, b


def _logged_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill
        return None


def _truncate_log(path: Path, step: int) -> None:
    """Keep the log lines of steps <= `step` (a killed run may have logged steps its checkpoint lacks, or
    half a line)."""
    if not path.exists():
        return
    text = path.read_text()
    lines = text.splitlines()
    keep = [line for line in lines if (s := _logged_step(line)) is not None and s <= step]
    if len(keep) != len(lines) or (text and not text.endswith("\n")):
        write_text_atomic(path, "".join(f"{line}\n" for line in keep))


def _resume(workload: Workload, model, optimizer, scheduler, resume_from: Path, state: dict, device) -> int:
    """Load the model, optimizer and scheduler of a checkpoint; returns its step (the first step to run)."""
    heartbeat(f"resume from {resume_from.name}")
    load_model(workload, model, resume_from)
    saved = torch.load(resume_from / "optimizer.pt", map_location=device)
    optimizer.load_state_dict(saved["optimizer"])  # restores the lr of step `start` too
    scheduler.load_state_dict(saved["scheduler"])
    return int(state["step"])


def _open_log(train: TrainConfig, ctx: TrainContext, start: int):
    """The main rank's log.jsonl, opened for appending after the lines of steps <= `start` (None elsewhere)."""
    if not (ctx.is_main and train.output_dir is not None):
        return None
    Path(train.output_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(train.output_dir) / "log.jsonl"
    _truncate_log(log_path, start)
    return open(log_path, "a")  # closed by train()


def _timed_step(workload: Workload, model, optimizer, scheduler, ctx: TrainContext, train: TrainConfig,
                step: int, tokens: float, flops: float | None, peak: float | None) -> dict:  # fmt: skip
    """One optimizer step, timed between device syncs; its metrics (time and peak memory: max over ranks)."""
    reset_peak_memory(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    seed_step(train.seed, step)
    result = train_step(model, optimizer, workload, ctx, step, grad_clip=train.grad_clip)
    scheduler.step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds, peak_mem = _max_over_ranks(time.perf_counter() - t0, peak_memory_gib(ctx.device), ctx.device)
    return {
        "step": step + 1,
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "denominator": result.denominator,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": None if flops is None or peak is None else flops / seconds / (ctx.world_size * peak * 1e12),
        "peak_mem_gib": peak_mem,
    }


def _report(metrics: dict, train: TrainConfig, bar, log_file) -> None:
    """Main rank: advance the bar, print every `log_every` steps (and the last), append to log.jsonl."""
    step = metrics["step"]
    bar.update(1)
    if step % train.log_every == 0 or step == train.steps:
        line = format_step(step, train.steps, metrics)
        bar.write(line) if train.progress else print(line, flush=True)
    if log_file is not None:
        log_file.write(json.dumps(metrics) + "\n")
        log_file.flush()


def _checkpoint_due(train: TrainConfig, step: int) -> bool:
    """After `step` steps: the last step, or every `save_every` (only with an output directory)."""
    if train.output_dir is None:
        return False
    return step == train.steps or bool(train.save_every and step % train.save_every == 0)


def train(
    workload: Workload, train: TrainConfig, parallel: ParallelConfig, *, recipe: dict | None = None
) -> list[dict]:
    """Train on an initialised process group; returns the per-step metrics (identical on every rank)."""
    heartbeat("build context")
    ctx = build_context(train, parallel)
    # Everything that can be refused is refused before the first write to output_dir.
    resume_from = check_output_dir(train)
    state = load_trainer_state(resume_from) if resume_from is not None else None
    if state is not None:
        check_resume(state, resume_from, ctx, train)
    heartbeat("build model")
    model, optimizer, scheduler, checkpointing = _build(workload, ctx, train)
    start = 0 if state is None else _resume(workload, model, optimizer, scheduler, resume_from, state, ctx.device)
    tokens = workload.tokens_per_step(ctx)
    flops = workload.flops_per_step(ctx)
    peak = peak_device_tflops(ctx.device, train.peak_tflops)
    history: list[dict] = []
    bar = progress_bar(
        total=train.steps, initial=start, disable=not (ctx.is_main and train.progress), desc="train"
    )
    log_file = _open_log(train, ctx, start)
    memory_scale = 1.0  # the memory model's peaks times this (`_step_down`, after a step ran out of memory)
    try:
        step = start
        while step < train.steps:
            try:
                metrics = _timed_step(
                    workload, model, optimizer, scheduler, ctx, train, step, tokens, flops, peak
                )
            except StepOutOfMemory as err:  # every rank: auto decides again and retries, or the same line
                retry = _step_down(workload, model, ctx, train, checkpointing, memory_scale, str(err))
                if retry is None:
                    advice = _out_of_memory_advice(workload, model, ctx, train, recipe or {}, checkpointing)
                    raise StepOutOfMemory(f"{err}; {advice}") from None
                memory_scale, checkpointing = retry
                continue  # the same step again (seed_step: it draws what it drew)
            history.append(metrics)
            if ctx.is_main:
                _report(metrics, train, bar, log_file)
            if _checkpoint_due(train, step + 1):
                heartbeat(f"step {step + 1}: checkpoint")
                if ctx.is_main:
                    save_checkpoint(
                        train.output_dir,
                        step + 1,
                        write_model=lambda p: save_model(workload, model, p),
                        optimizer_state={"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                        trainer_state={"step": step + 1, "layout": run_layout(ctx), "recipe": recipe or {}},
                        keep=train.keep_checkpoints,
                    )
                dist.barrier()
            step += 1
    finally:
        bar.close()
        if log_file is not None:
            log_file.close()
    heartbeat("done")
    return history
