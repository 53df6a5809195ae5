"""DFlash / DFlash2 drafters: config, model (SGLang-loadable names), per-rank plans and one training step.

configuration.py  DFlashConfig (Qwen3 config + block_size, num_target_layers, dflash_config)
conv.py           DFlash2 grouped dynamic depthwise convolution (causal inside a block)
selector.py       DFlash2 low-rank candidate selector
layer_attention.py  LayerAttention: what a layer attends with (the model is handed it; sharding.py builds it)
modeling.py       DFlashDraftModel / DFlash2DraftModel (attention is a callable per layer type)
sharding.py       per-rank plans of one step: reference / dp / cp / csbp
features.py       DrafterSample and load_context: the context feature rows a rank reads
step.py           one step's forward + backward in any mode
prefetch.py       the next step's plans and attention masks, built while this step runs
"""

from ...parallel.options import AttentionOptions
from .configuration import DFLASH2_ARCH, DFLASH_ARCH, DFlashConfig, build_target_layer_ids, make_dflash_config
from .conv import DFlashGroupedConv
from .modeling import DFlash2DraftModel, DFlashDraftModel, LayerAttention
from .prefetch import PreparedStep, StepPrefetcher
from .selector import CandidateSelector
from .sharding import (
    DRAFTER_MODES,
    DrafterPlan,
    anchor_costs,
    drafter_plans,
    plan_attention,
    reference_attention,
)
from .step import DrafterSample, StepResult, drafter_step, prepare_step, sync_gradients

__all__ = [
    "DFLASH2_ARCH",
    "DFLASH_ARCH",
    "DRAFTER_MODES",
    "AttentionOptions",
    "CandidateSelector",
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGroupedConv",
    "DrafterPlan",
    "DrafterSample",
    "LayerAttention",
    "PreparedStep",
    "StepPrefetcher",
    "StepResult",
    "anchor_costs",
    "build_target_layer_ids",
    "drafter_plans",
    "drafter_step",
    "make_dflash_config",
    "model_class",
    "plan_attention",
    "prepare_step",
    "reference_attention",
    "sync_gradients",
]


def model_class(config: DFlashConfig) -> type[DFlashDraftModel]:
    """DFlash2DraftModel or DFlashDraftModel, from config.architectures."""
    return DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel
