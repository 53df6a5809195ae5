"""What a drafter layer attends with: the contract between the model (modeling.py) and its plans (sharding.py).

The model never builds a plan; it is handed one `LayerAttention` per layer type and calls it:

    LayerAttention(attend, ctx_index, gather_ahead)
        attend(q, k, v) -> (out, lse)      over kv rows [selected context rows ; block rows]
        ctx_index                          which rows of the local context feed this layer type's K/V
        gather_ahead                       attend.begin(k_ctx, v_ctx) starts the context K/V gather early

A leaf module, so the model and the plans both import it and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...distributed.collectives import GatherHandle

__all__ = ["Attend", "LayerAttention", "LayerContext"]

#: a layer's attention: `attend(q, k, v) -> (out, lse)` (a ShardedAttention, MergedAttention, or any callable)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LayerAttention:
    """What one layer type attends with: `attend(q, k, v)` and which context rows feed its K/V.

    `gather_ahead`: `attend` has `begin(k_ctx, v_ctx) -> handle` (parallel/sharded_attention.py) and the
    model calls it for layer i + 1 before it runs layer i, so the context K/V's all-gather runs behind
    layer i instead of in front of layer i + 1's attention (a layer's context K/V depend on the target
    features only):

        ctx K/V(0), begin(0) | ctx K/V(1), begin(1) | layer 0 (waits 0) | ctx K/V(2), begin(2) | layer 1 ...
    """

    attend: Attend
    ctx_index: torch.Tensor | None = None  # rows of the (local) context; None = all of them
    gather_ahead: bool = False


@dataclass(frozen=True)
class LayerContext:
    """One layer's context K/V computed ahead, and the gather `begin` started from them (None: none)."""

    k: torch.Tensor
    v: torch.Tensor
    gathered: GatherHandle | None = None
