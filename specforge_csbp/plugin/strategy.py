"""`CSBPDraftTrainStrategy`: SpecForge's per-step seam for the plugin's strategies.

SpecForge builds it after wrapping `CSBPDrafterTrainingModel` (DDP), so the forward runs through the
wrapper. It returns the step's loss as `loss_terms = (numerator, denominator)`; SpecForge's TrainerCore
back-propagates the numerator, all-reduces the denominators over every rank and rescales the summed
gradients - the global denominator, exactly. Accuracy goes out as a ratio metric (summed over ranks, then
divided), so the logged numbers are global too.
"""

from __future__ import annotations

from typing import Any

import torch
from specforge.runtime.contracts import TrainBatch
from specforge.training.strategies.base import DraftTrainStrategy, StepContext, StepOutput

from .data import FEATURE

__all__ = ["CSBPDraftTrainStrategy"]


class CSBPDraftTrainStrategy(DraftTrainStrategy):
    required_features = frozenset({FEATURE})

    def __init__(self, wrapped_model: torch.nn.Module, *, name: str) -> None:
        self.model = wrapped_model
        self.name = name
        inner = getattr(wrapped_model, "module", wrapped_model)  # DDP / FSDP keep the module here
        # the metric keys must be the same on every rank (SpecForge packs them into one all-reduce)
        self.has_selector = getattr(inner.draft_model, "candidate_selector", None) is not None

    def trainable_module(self) -> torch.nn.Module:
        return self.model

    def forward_loss(self, batch: TrainBatch, ctx: StepContext | None = None) -> StepOutput:
        self.validate_batch(batch)
        step = ctx.global_step if ctx is not None else 0
        numerator, denominator, stats = self.model(sample_index=batch.tensors[FEATURE], global_step=step)

        def t(v):
            return numerator.detach().new_tensor(float(v))

        ratios: dict[str, Any] = {"acc": (t(stats["correct"]), t(stats["supervised"]))}
        if self.has_selector:
            ratios["selector_coverage"] = (t(stats["covered"]), t(stats["supervised"]))
        return StepOutput(
            loss=numerator,
            metrics={},
            ratio_metrics=ratios,
            loss_terms=(numerator, denominator),
        )

    def checkpoint_state_filter(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Drafter weights only, under the drafter's own (= SGLang's) parameter names."""
        return {k[len("draft_model.") :]: v for k, v in state_dict.items() if k.startswith("draft_model.")}
