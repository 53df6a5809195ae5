"""Checks the trainer makes before it writes anything, and the non-finite guard's tensor scan.

    train(): context -> check_output_dir -> latest checkpoint (complete?) -> check_resume -> model ...
             -> first write (log.jsonl, checkpoints)

Each failure is one line naming the field and what is allowed. Recipe-level checks (degrees, lengths, block
sizes, vocab, routability) live with the recipe (`models/bdlm/recipe.py`) and its sections; this module
holds only what the generic trainer itself knows.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..preflight import check_writable_dir
from .checkpoint import checkpoint_step, latest_checkpoint, verify_checkpoint

if TYPE_CHECKING:
    from .config import TrainConfig
    from .context import TrainContext

__all__ = ["check_output_dir", "check_resume", "first_nonfinite", "run_layout"]


def check_output_dir(train: TrainConfig) -> Path | None:
    """Validate `train.output_dir` against `train.resume`; returns the checkpoint to resume from (or None)."""
    if train.output_dir is None:
        return None
    out = Path(train.output_dir)
    check_writable_dir(out, "train.output_dir")  # a file, a file on its path, read-only: before any step
    latest = latest_checkpoint(out)  # a pointer to an incomplete checkpoint is an error in any case
    if not train.resume:
        held = latest or next((p for p in sorted(out.glob("step_*")) if checkpoint_step(p) is not None), None)
        if held is not None:
            raise ValueError(
                f"train.output_dir: {out} already holds checkpoints ({held.name}) and train.resume is false; "
                f"set train.resume=true to continue that run or use a new train.output_dir"
            )
        return None
    if latest is not None:
        verify_checkpoint(latest)  # a flipped byte is refused before it is loaded
    return latest


def run_layout(ctx: TrainContext) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (checked or reported on resume)."""
    return {
        "seed": ctx.seed, "global_batch": ctx.global_batch, "world_size": ctx.world_size,
        "dp_degree": ctx.dp_size, "cp_degree": ctx.cp_size, "mode": ctx.mode,
    }  # fmt: skip


def check_resume(state: dict[str, Any], path: Path, ctx: TrainContext, train: TrainConfig) -> None:
    """The resumed run must see the same data and noise: same seed and the same global batch (sequences per
    step = dp_degree x micro_batch_size x grad_accum); world size, DP degree and CP mode may change."""
    saved = state.get("layout", {})
    if "seed" in saved and saved["seed"] != ctx.seed:
        raise ValueError(
            f"train.seed: {ctx.seed} differs from the seed {saved['seed']} of {path}; a resumed run must keep "
            f"the seed (its data and noise depend on it) - use a new train.output_dir to change it"
        )
    if "global_batch" in saved and saved["global_batch"] != ctx.global_batch:
        raise ValueError(
            f"train.micro_batch_size x train.grad_accum x dp_degree = {ctx.micro_batch_size} x "
            f"{ctx.grad_accum} x {ctx.dp_size} = {ctx.global_batch} sequences per step, but {path} was "
            f"trained with {saved['global_batch']}; a resumed run must keep the global batch"
        )
    if int(state["step"]) > train.steps:
        raise ValueError(
            f"train.steps: {train.steps} is below the step {state['step']} of the checkpoint {path}; it must be "
            f">= {state['step']}"
        )


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """'name (k nan, j inf of n)' for the first tensor holding a NaN or an Inf, else None.

    One fused norm per tensor list decides; the element counts are computed only for the offender."""
    items = [(n, t) for n, t in named if t is not None]
    if not items:
        return None
    by_device: dict[tuple, list[int]] = {}
    for i, (_, t) in enumerate(items):
        by_device.setdefault((t.device, t.dtype), []).append(i)
    bad: list[int] = []
    for idx in by_device.values():
        norms = torch._foreach_norm([items[i][1].detach() for i in idx])
        finite = torch.isfinite(torch.stack(norms)).cpu()
        bad += [i for i, ok in zip(idx, finite.tolist()) if not ok]
    for i in sorted(bad):
        name, t = items[i]
        t = t.detach()
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            return f"{name} ({nan} nan, {inf} inf of {t.numel()})"
        return f"{name} (finite values whose norm overflows {t.dtype})"
    return None
