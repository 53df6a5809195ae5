"""The seam between the generic trainer and what is trained (a BDLM, a DFlash drafter, ...).

    trainer                                   workload
    ───────                                   ────────
    build_context ─────────────────────────► build_model(ctx)                  same init on every rank
    for step:                                microbatches(ctx, step)           this rank's rows, from
      denom = all_reduce(sum(mb.denominator)) ◄──                              (seed, step) only
      for mb: (loss_numerator(model, mb) / denom).backward()
      all_reduce(grads); clip; AdamW; schedule
      log tokens_per_step / flops_per_step

Numerators are sums over this rank's rows; denominators are this rank's share of the global count (each
supervised row counted on exactly one rank), so the all-reduced loss and gradients equal the
single-process reference's exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..preflight import check_finite_tensors
from .context import TrainContext

__all__ = ["MicroBatch", "Workload", "load_model", "save_model"]


@runtime_checkable
class MicroBatch(Protocol):
    @property
    def denominator(self) -> float:
        """This rank's share of the global loss denominator."""


@runtime_checkable
class Workload(Protocol):
    def build_model(self, ctx: TrainContext) -> nn.Module:
        """The model on ctx.device; must initialise identically on every rank (the trainer seeds first)."""

    def microbatches(self, ctx: TrainContext, step: int) -> Sequence[MicroBatch]:
        """ctx.grad_accum micro batches for this rank, a pure function of (ctx.seed, step, rank layout)."""

    def loss_numerator(self, model: nn.Module, batch: MicroBatch, ctx: TrainContext) -> torch.Tensor:
        """Scalar: sum of weighted per-row losses over this rank's rows of `batch`."""

    def tokens_per_step(self, ctx: TrainContext) -> int:
        """Tokens one optimizer step processes over the whole job (for tokens/s)."""

    def flops_per_step(self, ctx: TrainContext) -> float | None:
        """Model FLOPs of one optimizer step over the whole job (for MFU), or None."""


def save_model(workload: Workload, model: nn.Module, path: Path) -> None:
    """Workload's `save_model(model, path)` if it has one, else safetensors of the whole module."""
    custom = getattr(workload, "save_model", None)
    if custom is not None:
        custom(model, path)
        return
    from safetensors.torch import save_model as st_save

    st_save(model, str(path / "model.safetensors"))


def load_model(workload: Workload, model: nn.Module, path: Path) -> None:
    """The checkpoint's weights into `model`, then checked finite (a resume continues from them)."""
    custom = getattr(workload, "load_model", None)
    if custom is not None:
        custom(model, path)
    else:
        from safetensors.torch import load_model as st_load

        st_load(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    check_finite_tensors(dict(model.named_parameters()), "train.output_dir", path)
