"""Route every attention layer of a transformers model through this rank's `ShardedAttention`.

transformers models that use the attention interface call

    ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=..., **kwargs)

in every layer, after their own q/k/v projections, q/k norms and RoPE. We register one function under
`ATTENTION_NAME` and pass the rank's executor as a forward keyword (`ROUTE_KWARG`), which transformers
hands unchanged to every layer's attention call - so no model code is forked:

    embed ─► [ q/k/v proj, norms, RoPE(pos) ─► routed_attention ─► o_proj ─► MLP ] x layers ─► norm
              token-wise, local rows only       ShardedAttention(plan):      token-wise, local
                                                local + gathered K/V, merged

Sliding-window layers: transformers passes a sliding layer's window as the `sliding_window` keyword
(Gemma 3, Qwen2 with `use_sliding_window`, Mistral / Mixtral; `config.layer_types` says which layers);
that layer then runs the executor's windowed sibling (`ShardedAttention.windowed`), the same plan under the
same visibility rule with the window on clean keys (masks/visibility.py, docs/bdlm.md). Full layers run
the executor itself.

Kept attention under activation checkpointing (`keep_attention_outputs`, train.recompute_attention): a
checkpointed layer normally runs its whole forward again in backward, attention (the largest share of a
long-context layer's FLOPs) and its collectives included. With attention kept, the attention call saves
what its backward needs (q, k, v, out, lse, gathered K/V) outside the checkpoint, and the recompute takes
the output it already has instead of attending again:

    forward   [norms, q/k/v proj ─► attention ─► o_proj, MLP]   checkpoint drops all saved tensors but
                                    saves q,k,v,out,lse          attention's (kept on the layer's route)
    backward  recompute [norms, q/k/v proj ─► (out, kept) ─► o_proj, MLP]  no attention, no collectives
              then the original graph's backward, attention's node on its own saved tensors

The gradients are the un-checkpointed ones exactly (the same graph, the same saved values); the memory is
`planner/memory.py: attention_bytes_per_row` per row and layer.

Models we cannot route fail with one line naming the model and the reason (`check_routable`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch import nn

from ...parallel import ShardedAttention

__all__ = [
    "ATTENTION_NAME",
    "KEEP_ATTENTION",
    "ROUTABLE_LAYER_TYPES",
    "ROUTE_KWARG",
    "Route",
    "check_routable",
    "check_windows",
    "config_windows",
    "keep_attention_outputs",
    "register_attention",
    "routed_attention",
]

ATTENTION_NAME = "specforge_csbp"
ROUTE_KWARG = "csbp_route"
KEEP_ATTENTION = "csbp_keep_attention"  # attribute of an attention module whose output its recompute reuses

# Layer types the rule does not model, and why (config.layer_types; anything else unknown is refused too).
ROUTABLE_LAYER_TYPES = ("full_attention", "sliding_attention")
_UNROUTABLE_LAYER_TYPES = {
    "linear_attention": "a recurrent state instead of softmax attention over keys (no mask applies)",
    "mamba": "a state-space recurrence, not attention",
    "conv": "a short convolution, not attention",
    "chunked_attention": "chunk-local attention (keys of the query's own chunk only) is not built",
    "hybrid": "a mixed attention / recurrent layer",
}

# Config fields that change the attention or logits in ways the visibility rule / linear CE do not model.
_UNSUPPORTED_CONFIG = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "logit_scale": "a logit scale",
    "logits_scaling": "a logit scale",
}


@dataclass
class Route:
    """What one forward routes: the rank's executor, the sequence length, and a call counter that proves
    every layer went through it (a model that bypasses the interface in some layer is caught)."""

    attention: ShardedAttention
    seq_len: int
    calls: int = 0
    windows: list[int | None] = field(default_factory=list)  # each routed call's window (None: full)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # id(attention module) -> its kept output

    def executor(self, window: int | None, module: str) -> ShardedAttention:
        """The executor of a layer with sliding window `window` (None or >= seq_len: the full one)."""
        self.windows.append(window if window is not None and window < self.seq_len else None)
        if self.windows[-1] is None:
            return self.attention
        windowed = getattr(self.attention, "windowed", None)
        if windowed is None:
            raise ValueError(f"model: {module} has sliding_window={window}; the executor has no windowed form")
        block = self.attention.block_size
        if window < block:
            raise ValueError(
                f"model: {module} has sliding_window={window} < model.block_size={block}; a corrupted block "
                f"must fit in the window (use model.block_size <= {window})"
            )
        return windowed(window)


# Opaque to dynamo (`BDLMModel.compile_token_wise` compiles the attention module around this call): the
# executor is plan-driven Python with collectives and saved-tensor hooks; the kernels it calls compile
# themselves (a torch.compile'd function called in here still compiles).
@torch.compiler.disable
def routed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: SDPA layout in ([B, H, N, D]), [B, N, H, D] out."""
    route = kwargs.get(ROUTE_KWARG)
    name = type(module).__name__
    if route is None:
        raise RuntimeError(
            f"{name}: attention implementation {ATTENTION_NAME!r} needs a BDLM plan; run the model through "
            f"specforge_csbp.models.bdlm.BDLMModel (or set config._attn_implementation back to 'sdpa')"
        )
    executor = route.executor(kwargs.get("sliding_window"), name)
    for option in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(option) is not None:
            raise ValueError(
                f"model: {name} passes {option} to its attention; cannot be routed (full softmax only)"
            )
    if dropout:
        raise ValueError(f"model: {name} has attention dropout {dropout}; set config.attention_dropout=0")
    # Under autocast the projections are low precision but q/k norms and RoPE may promote q, k to fp32.
    dtype = (
        torch.get_autocast_dtype(query.device.type)
        if torch.is_autocast_enabled(query.device.type)
        else query.dtype
    )
    query, key, value = (t.to(dtype) for t in (query, key, value))
    route.calls += 1
    if not (getattr(module, KEEP_ATTENTION, False) and torch.is_grad_enabled()):
        out, _ = executor(query, key, value, scale=scaling)
        return out.transpose(1, 2), None
    kept = route.kept.get(id(module))
    if kept is not None:
        if not _in_backward():
            raise RuntimeError(f"{name}: one attention module called twice in a forward; cannot keep its output")
        return kept.transpose(1, 2), None  # a checkpointed layer's recompute: the output it has, no attention
    # the innermost saved-tensor hooks win: these keep attention's saved tensors out of a checkpoint's hooks
    with saved_tensors_hooks(_keep, _keep):
        out, _ = executor(query, key, value, scale=scaling)
    route.kept[id(module)] = out
    return out.transpose(1, 2), None


def keep_attention_outputs(layers: list[nn.Module], keep: bool = True) -> int:
    """Mark the attention module (`self_attn`) of each decoder layer in `layers` to keep its output for
    the layer's checkpoint recompute (`keep=False`: to attend again). Returns how many were marked."""
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise ValueError(f"model: {type(layer).__name__} has no self_attn; its attention cannot be kept")
        setattr(attn, KEEP_ATTENTION, keep)
    return len(layers)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _in_backward() -> bool:
    """Inside an autograd graph task: where torch.utils.checkpoint recomputes a layer."""
    return torch._C._current_graph_task_id() != -1


def register_attention() -> None:
    """Register `routed_attention` under `ATTENTION_NAME` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, routed_attention)


def check_routable(lm: nn.Module) -> None:
    """One-line ValueError naming the model and why, for causal LMs whose attention cannot be routed."""
    name = type(lm).__name__
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_output_embeddings"):
        raise ValueError(f"model: {name} is not a transformers causal LM (no config / output embeddings)")
    if not getattr(lm, "_supports_attention_backend", False):
        raise ValueError(
            f"model: {name} does not route attention through transformers' AttentionInterface "
            f"(_supports_attention_backend=False); use a model that does, e.g. Qwen3 or Llama"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model: {name} is an encoder-decoder; only decoder-only causal LMs can be routed")
    for key, what in _UNSUPPORTED_CONFIG.items():
        value = getattr(config, key, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"model: {name} config.{key}={value} applies {what}; cannot be routed")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"model: {name} config.use_bidirectional_attention=True (an encoder); "
            "only causal LMs can be routed"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ROUTABLE_LAYER_TYPES})
    if other:
        why = _UNROUTABLE_LAYER_TYPES.get(other[0], "a layer type the BDLM visibility rule does not model")
        raise ValueError(
            f"model: {name} config.layer_types has {other!r}: {why}; only "
            f"{' and '.join(ROUTABLE_LAYER_TYPES)} layers can be routed"
        )
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model: {name} output embeddings are {type(head).__name__}, expected nn.Linear")


def config_windows(config) -> list[int | None]:
    """Each layer's sliding window as the config declares it (None: full attention): `layer_types` where
    the config has them (Gemma 3, Qwen2 / Qwen3 with use_sliding_window), else `sliding_window` on every
    layer (Mistral, Mixtral). The routed forward records what the layers actually pass
    (`BDLMModel.layer_windows`)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(config, "use_sliding_window", None) is False:
        return [None] * layers
    return [window] * layers


def check_windows(config, block_size: int, seq_len: int) -> None:
    """One-line error when a sliding window shorter than the sequence cannot hold a corrupted block."""
    for window in config_windows(config):
        if window is not None and window < min(block_size, seq_len):
            raise ValueError(
                f"model: config.sliding_window={window} < model.block_size={block_size}; a corrupted block "
                f"must fit in the window of a sliding layer (use model.block_size <= {window})"
            )
