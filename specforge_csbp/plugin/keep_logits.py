"""`csbp.keep_logits_gib` when the run leaves it unset: chosen from this device's free memory and the
planner's memory model of the run's drafter step.

    free memory of this rank's GPU (torch.cuda.mem_get_info, before the model is built)
  - predicted peak of one drafter step with the logits recomputed (planner/memory.py drafter_step_memory
    for this run's drafter, max_length, anchors, block size, CP size and mode; + the prefetched samples'
    context features when csbp.prefetch_features: one, or as many of a batch as fit AHEAD_TOKENS)
  - headroom (HEADROOM_GIB + HEADROOM_SHARE of the prediction: the model's measured error is within 12%,
    the allocator's fragmentation on top)
  = budget  -> keep_logits_gib = budget when this rank's [rows, vocab] logits fit in it, else 0 (recompute)

Kept logits save one [rows, vocab] GEMM per loss chunk (objectives/linear_ce_topk.py) for the memory they
hold (the measured trade: docs/performance.md, "`csbp.keep_logits_gib` by default"). Without a GPU (CPU runs, tests) the choice is 0. An explicit `csbp.keep_logits_gib` (0 turns it
off) is never changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import load_json
from ..planner.memory import drafter_step_memory
from ..planner.pairs import drafter_rank_stats
from ..planner.shapes import load_shape
from .prefetch_jobs import AHEAD_TOKENS

__all__ = ["HEADROOM_GIB", "HEADROOM_SHARE", "KeepLogitsChoice", "choose_keep_logits_gib", "resolve_keep_logits"]

GiB = float(1 << 30)
HEADROOM_GIB = 2.0
HEADROOM_SHARE = 0.15
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class KeepLogitsChoice:
    """The chosen threshold and what it was chosen from (GiB), for the one line a run prints."""

    keep_logits_gib: float
    free_gib: float | None = None
    step_gib: float | None = None
    logits_gib: float | None = None
    reason: str = ""

    def line(self) -> str:
        if self.free_gib is None:
            return f"csbp.keep_logits_gib auto -> {self.keep_logits_gib:g} ({self.reason})"
        kept = "kept" if self.keep_logits_gib else "recomputed"
        return (
            f"csbp.keep_logits_gib auto -> {self.keep_logits_gib:.1f} GiB (free {self.free_gib:.1f} GiB, predicted "
            f"step {self.step_gib:.1f} GiB, this rank's logits {self.logits_gib:.1f} GiB: {kept})"
        )


def choose_keep_logits_gib(free_gib: float, step_gib: float, logits_gib: float) -> float:
    """The budget left after the predicted step and the headroom when `logits_gib` fits in it, else 0."""
    budget = free_gib - step_gib - (HEADROOM_GIB + HEADROOM_SHARE * step_gib)
    return round(budget, 2) if 0 < logits_gib <= budget else 0.0


def _draft_config(path: str | None) -> dict:
    if not path:
        raise ValueError("no model.draft_model_config")
    src = path if path.endswith(".json") else os.path.join(path, "config.json")
    return load_json(src, "model.draft_model_config")


def predicted_step(cfg, options, cp_size: int, mode: str) -> tuple[float, float]:
    """(peak GiB of one rank's drafter step with the logits recomputed, that rank's kept-logits GiB), the
    largest over the ranks, from the planner's memory model."""
    raw = _draft_config(cfg.model.draft_model_config)
    shape = load_shape(raw, workload="drafter")
    block = int((raw.get("dflash_config") or {}).get("block_size") or raw.get("block_size") or 16)
    context = cfg.data.max_length // block * block
    anchors = int(cfg.training.num_anchors)
    e = _ELEM_BYTES.get(cfg.model.torch_dtype, 2)
    chunk_blocks = int(cfg.training.objective_chunk_blocks)
    windows = sorted(set(shape.windows), key=lambda w: (w is not None, w or 0))
    per_window = {w: drafter_rank_stats(mode, context, anchors, block, cp_size, w) for w in windows}
    # samples the look-ahead builds at once: the CP group's micro-step, while their tokens fit AHEAD_TOKENS
    group_batch = int(getattr(cfg.training, "batch_size", 1) or 1) * cp_size
    ahead = max(1, min(group_batch, AHEAD_TOKENS // max(context, 1)))
    step, logits = 0.0, 0.0
    for r in range(len(per_window[windows[0]])):
        stats = {w: per_window[w][r] for w in windows}
        rows = stats[windows[0]].anchors * (block - 1)
        chunk = chunk_blocks * block if chunk_blocks > 0 else max(rows, 1)
        mem = drafter_step_memory(shape, stats, elem_bytes=e, state_bytes=16.0, ce_chunk=chunk, reserved_gib=0.0)
        total = mem.total
        if options.prefetch_features:  # the next samples' context features, read ahead (plugin/data.py)
            ctx = max(s.context_rows for s in stats.values())
            total += ahead * ctx * shape.features * shape.target_hidden * e / GiB
        step = max(step, total)
        logits = max(logits, rows * shape.vocab * e / GiB)
    return step, logits


def _free_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    free, _total = torch.cuda.mem_get_info(device)
    return free / GiB


def resolve_keep_logits(cfg, options, cp_size: int, mode: str) -> KeepLogitsChoice:
    """The automatic choice for this process's GPU (0 without one, or when the prediction fails)."""
    free = _free_gib()
    if free is None:
        return KeepLogitsChoice(0.0, reason="no GPU: recomputed")
    try:
        step, logits = predicted_step(cfg, options, cp_size, mode)
    except (ValueError, OSError, KeyError) as err:  # no readable drafter config: the safe choice
        return KeepLogitsChoice(0.0, reason=f"no memory prediction ({str(err).splitlines()[0]}): recomputed")
    return KeepLogitsChoice(choose_keep_logits_gib(free, step, logits), free, step, logits)
