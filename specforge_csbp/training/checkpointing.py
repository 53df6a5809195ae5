"""`train.activation_checkpointing: auto` (the default): checkpoint the decoder layers only when a step
would not fit in the device's memory without.

    predicted peak of one rank's step WITHOUT checkpointing      planner/memory.py bdlm_step_memory for
      (states, every layer's saved activations, gathered K/V,    this rank's rows: the workload's sequence
       the loss chunk)                                           length, block size, objective views x
                                                                 micro batch, the CP plan, the precision
      + under autocast: the fp32 copies HF's RMSNorms save        AUTOCAST_ROW_BYTES_PER_HIDDEN x hidden per
        (the planner counts every activation in bf16) and the     row and layer (measured on a Qwen3 layer:
        bf16 weight copies autocast caches for the step           tests/test_activation_checkpointing_auto.py),
                                                                  2 bytes per parameter
    + headroom (HEADROOM_GIB + HEADROOM_SHARE of it: the model's measured error is within 12%)
    <= memory this process can use (free + what it already holds: the model's weights)
       -> off: no recompute (a third fewer FLOPs than a checkpointed step's)
       else on

Without a GPU the choice is off (host memory is not what the planner models); a workload without a memory
model (no seq_len / objective / ce_chunk_size, or a model without a config) also gets off, and the line
printed says so. An explicit true / false is never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HEADROOM_GIB", "HEADROOM_SHARE", "CheckpointingChoice", "bdlm_peak_gib", "needs_checkpointing",
           "resolve_checkpointing"]  # fmt: skip

GiB = float(1 << 30)
#: bytes per row, layer and hidden unit that a Qwen3 decoder layer saves under bf16 autocast with fp32
#: weights beyond the planner's bf16 count (layer_activation_bytes_per_row): RMSNorm's fp32 input and
#: normalised copies. Measured with saved-tensor hooks: 13,109 vs 10,512 B per row at hidden 256 (10.1 x h).
AUTOCAST_ROW_BYTES_PER_HIDDEN = 10
HEADROOM_GIB = 2.0
HEADROOM_SHARE = 0.15


@dataclass(frozen=True)
class CheckpointingChoice:
    enabled: bool
    reason: str

    def line(self) -> str:
        return f"train.activation_checkpointing auto -> {'on' if self.enabled else 'off'} ({self.reason})"


def needs_checkpointing(peak_gib: float, available_gib: float) -> bool:
    """Does a step predicted at `peak_gib` (without checkpointing) overflow `available_gib` with headroom?"""
    return peak_gib + HEADROOM_GIB + HEADROOM_SHARE * peak_gib > available_gib


def bdlm_peak_gib(workload, model, ctx, *, checkpointing: bool) -> float:
    """Predicted peak GiB of this run's largest rank for a BDLM workload (ValueError: no memory model)."""
    from ..planner.memory import bdlm_step_memory
    from ..planner.pairs import bdlm_rank_stats
    from ..planner.shapes import load_shape

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

    def autocast_extra(s) -> float:
        if not ctx.autocast_dtype:
            return 0.0
        layers = 1 if checkpointing else shape.layers  # checkpointed: one layer's activations live at a time
        rows = views * s.q_rows
        return (layers * rows * AUTOCAST_ROW_BYTES_PER_HIDDEN * shape.hidden + 2 * shape.trainable_params) / GiB

    return max(
        bdlm_step_memory(shape, s, views=views, elem_bytes=elem, state_bytes=4.0 * param_bytes,
                         checkpointing=checkpointing, ce_chunk=chunk, reserved_gib=0.0,
                         residual_bytes=param_bytes if ctx.autocast_dtype else elem).total + autocast_extra(s)
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
    except ValueError as err:
        return CheckpointingChoice(False, str(err))
    available = _available_gib(ctx.device)
    on = needs_checkpointing(peak, available)
    verb = ">" if on else "<="
    return CheckpointingChoice(on, f"predicted {peak:.1f} GiB without it + headroom {verb} {available:.1f} GiB")
