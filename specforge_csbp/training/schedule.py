"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

lr
peak ┤    ╭──╮
     │   ╱    ╲__
     │  ╱        ╲___
floor┤ ╱             ╲______
     └─┴──────────────────── step
       warmup          steps
"""

from __future__ import annotations

import math

import torch

__all__ = ["build_scheduler", "warmup_cosine"]


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float
):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(s, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio),
    )
