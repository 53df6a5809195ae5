"""`train.activation_checkpointing: auto` (the default): checkpoint the decoder layers only when a step
would not fit in the device's memory without.

    predicted peak of one rank's step WITHOUT checkpointing      planner/memory.py bdlm_step_memory for
      (states, every layer's saved activations, gathered K/V,    this rank's rows: the workload's sequence
       the loss chunk)                                           length, block size, objective views x
                                                                 micro batch, the CP plan, the precision
      (every layer: what its family's decoder layer saves        decoder_layer_bytes_per_row: norms in fp32,
       per row - measured per family on the CPU,                  GEMM outputs in the autocast dtype, the
       tests/planner/test_decoder_layer_memory_vs_measured.py)    residual stream in the weights' dtype
      + under autocast: the bf16 weight copies autocast caches    2 bytes per parameter
        for the step
    + headroom (HEADROOM_GIB + HEADROOM_SHARE of it: the GPU points behind it at HEADROOM_SHARE)
    <= memory this process can use (free + what it already holds: the model's weights)
       -> off: no recompute (a third fewer FLOPs than a checkpointed step's)
       else on, for as few layers as fit: each decoder layer left un-checkpointed adds
       (peak without - peak with checkpointing) / layers; the last k layers keep their activations
       (their backward runs first, so their memory is free again before the recomputes start)

Without a GPU the choice is off (host memory is not what the planner models); a workload without a memory
model (no seq_len / objective / ce_chunk_size, or a model without a config) also gets off, and the line
printed says so. An explicit true / false is never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planner.memory import bdlm_step_memory
from ..planner.pairs import bdlm_rank_stats
from ..planner.shapes import load_shape

__all__ = ["HEADROOM_GIB", "HEADROOM_SHARE", "CheckpointingChoice", "bdlm_peak_gib", "keep_activations",
           "layers_that_fit", "needs_checkpointing", "peak_keeping", "resolve_checkpointing"]  # fmt: skip

GiB = float(1 << 30)
HEADROOM_GIB = 2.0
#: the GPU points on one H200 (benchmarks/results/bdlm_h200_2026-12-01.jsonl) against this rule's
#: prediction (peak_all + k x per layer) for the setting the former model chose at 139 GiB: Qwen3-1.7B 64K
#: keeping 2 of 28 layers
#: 113.2 GiB predicted / 100.8 measured, Qwen3-MoE-3B 32K keeping 7 of 24: 142.0 / 131.5 - 8-12% over
#: (the rule counts one recomputed layer on top of the kept ones, which never coexist); Gemma-3-1B 32K
#: keeping 13 of 26 (the former model's choice) ran out at step 1 where this predicts 136.3, >= 2% under;
#: Qwen3-1.7B 16K without checkpointing ran out (134.6 GiB allocated) at 155.5 predicted. A quarter keeps
#: the margin for what the model does not count (allocator fragmentation, a backward's working set)
HEADROOM_SHARE = 0.25


@dataclass(frozen=True)
class CheckpointingChoice:
    enabled: bool
    reason: str
    keep_layers: int = 0  # decoder layers (the last ones) that keep their activations when enabled
    layers: int = 0

    def line(self) -> str:
        if not self.enabled:
            what = "off"
        elif self.keep_layers:
            what = f"on for {self.layers - self.keep_layers} of {self.layers} layers"
        else:
            what = "on"
        return f"train.activation_checkpointing auto -> {what} ({self.reason})"


def needs_checkpointing(peak_gib: float, available_gib: float) -> bool:
    """Does a step predicted at `peak_gib` (without checkpointing) overflow `available_gib` with headroom?"""
    return peak_gib + HEADROOM_GIB + HEADROOM_SHARE * peak_gib > available_gib


def peak_keeping(peak_none: float, peak_all: float, layers: int, keep: int) -> float:
    """Predicted peak with `keep` of `layers` decoder layers keeping their activations, the others
    checkpointed: peak_all + keep (peak_none - peak_all) / layers."""
    return peak_all + keep * (peak_none - peak_all) / max(1, layers)


def layers_that_fit(peak_none: float, peak_all: float, layers: int, available_gib: float) -> int:
    """How many decoder layers can keep their activations (the others checkpointed) within
    `available_gib`: all when the un-checkpointed step fits, else the most k whose `peak_keeping` fits
    (0: checkpoint every layer)."""
    if not needs_checkpointing(peak_none, available_gib):
        return layers
    k = 0
    while k + 1 < layers and not needs_checkpointing(peak_keeping(peak_none, peak_all, layers, k + 1), available_gib):
        k += 1
    return k


def bdlm_peak_gib(workload, model, ctx, *, checkpointing: bool) -> float:
    """Predicted peak GiB of this run's largest rank for a BDLM workload (ValueError: no memory model)."""
    try:
        seq_len, objective, chunk = workload.seq_len, workload.objective, workload.ce_chunk_size
        config, block, rule = model.config, model.block_size, model.clean_within_block
    except AttributeError as err:
        raise ValueError(f"no memory model for this workload ({err})") from None
    shape = load_shape(config.to_dict())
    stats = bdlm_rank_stats(ctx.mode, seq_len, block, ctx.cp_size, rule)
    param_bytes = torch.tensor([], dtype=ctx.param_dtype).element_size()
    elem = torch.tensor([], dtype=ctx.autocast_dtype).element_size() if ctx.autocast_dtype else param_bytes
    views = objective.batch_factor * ctx.micro_batch_size

    weight_copies = 2 * shape.trainable_params / GiB if ctx.autocast_dtype else 0.0  # autocast's bf16 cache
    return max(
        bdlm_step_memory(shape, s, views=views, elem_bytes=elem, state_bytes=4.0 * param_bytes,
                         checkpointing=checkpointing, ce_chunk=chunk, reserved_gib=0.0,
                         residual_bytes=param_bytes).total + weight_copies
        for s in stats
    )  # fmt: skip


def _available_gib(device: torch.device) -> float:
    free, _total = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_allocated(device)) / GiB


def resolve_checkpointing(workload, model, ctx) -> CheckpointingChoice:
    """The `auto` decision for this rank (every rank of a run computes the same prediction; each rank's
    free memory may differ, so the trainer takes the OR over ranks)."""
    if ctx.device.type != "cuda":
        return CheckpointingChoice(False, "no GPU")
    try:
        peak = bdlm_peak_gib(workload, model, ctx, checkpointing=False)
        peak_all = bdlm_peak_gib(workload, model, ctx, checkpointing=True)
    except ValueError as err:
        return CheckpointingChoice(False, str(err))
    available = _available_gib(ctx.device)
    layers = int(model.config.num_hidden_layers)
    keep = layers_that_fit(peak, peak_all, layers, available)
    on = keep < layers
    verb = ">" if on else "<="
    reason = f"predicted {peak:.1f} GiB without it + headroom {verb} {available:.1f} GiB"
    if on:
        reason += f"; {peak_all:.1f} GiB with every layer checkpointed"
        if keep:
            reason += f"; {peak_keeping(peak, peak_all, layers, keep):.1f} GiB as chosen"
    return CheckpointingChoice(on, reason, keep_layers=keep if on else 0, layers=layers)


def keep_activations(model: torch.nn.Module, keep: int) -> int:
    """After checkpointing was enabled on every layer: the last `keep` checkpointed layers (transformers'
    GradientCheckpointingLayer flag, in module order) keep their activations instead. Returns how many."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers[len(layers) - min(keep, len(layers)) :] if keep > 0 else []:
        m.gradient_checkpointing = False
    return min(max(keep, 0), len(layers))
