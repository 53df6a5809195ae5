"""The `train-bdlm` recipe: model / data / objective sections on top of the generic parallel / train ones.

model:     {config: {model_type: qwen3, ...}} (random weights) | {pretrained: DIR}; block_size
data:      synthetic | jsonl, max_length (a multiple of block_size)
objective: sft | convert, mask_token_id (inside the vocab), noise, weighting, denominator
parallel:  mode (csbp | cp | bp), cp_degree, dp_degree, world_size (CPU self-spawn)
train:     steps, batch, AdamW, schedule, clipping, precision, checkpoints
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...layout.plans import check_bdlm_shape
from ...objectives.convert import ConvertObjective
from ...objectives.sft import SFTObjective
from ...preflight import check_local_path, check_weights_dir, check_writable_dir
from ...training.config import ParallelConfig, Section, Size, TrainConfig
from .adapter import BDLMModel
from .data import JsonlSource, SyntheticSource
from .routing import check_routable, check_windows
from .workload import BDLMWorkload

__all__ = ["BDLMRecipe", "DataSection", "ModelSection", "ObjectiveSection", "build_workload", "preflight"]


class ModelSection(Section):
    config: dict[str, Any] | None = Field(
        None, description="transformers config (with model_type): random weights"
    )
    pretrained: str | None = Field(None, description="a from_pretrained directory")
    block_size: int = Field(16, ge=1)
    clean_within_block: Literal["causal", "bidirectional"] = "causal"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.config is None) == (self.pretrained is None):
            raise ValueError("set exactly one of model.config (random weights) and model.pretrained")
        return self


class DataSection(Section):
    source: Literal["synthetic", "jsonl"] = "synthetic"
    path: str | None = None
    max_length: Size = Field(
        256, ge=1, description="clean tokens per sequence; a multiple of model.block_size"
    )
    pad_token_id: int = Field(0, ge=0)
    prompt_len: int = Field(0, ge=0, description="synthetic: leading tokens that are never masked/supervised")

    @model_validator(mode="after")
    def _path(self) -> DataSection:
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path is required for source 'jsonl'")
        return self


class ObjectiveSection(Section):
    kind: Literal["sft", "convert"] = "sft"
    mask_token_id: int
    eps: float = Field(1e-3, gt=0, lt=1)
    noise: Literal["stratified", "antithetic", "uniform"] | None = Field(
        None, description="default: stratified (sft), uniform (convert, as Fast-dLLM v2)"
    )
    weighting: Literal["inv_t", "unit"] = "inv_t"
    denominator: Literal["eligible", "masked"] = "eligible"
    exclude_mask_from_softmax: bool = True
    ce_chunk_size: Size = Field(4096, ge=1)
    router_aux_loss_coef: float | None = Field(
        None, ge=0, description="MoE load-balancing loss weight; default: the model config's "
        "router_aux_loss_coef when config.output_router_logits, else 0"
    )
    router_aux_tokens: Literal["both", "clean", "corrupted"] = Field(
        "both", description="rows of the 2L sequence the load-balancing statistics count"
    )


class BDLMRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSection
    data: DataSection = DataSection()
    objective: ObjectiveSection
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _shapes(self) -> BDLMRecipe:
        if self.data.max_length % self.model.block_size:
            raise ValueError(
                f"data.max_length ({self.data.max_length}) must be a multiple of model.block_size "
                f"({self.model.block_size}); pad or truncate the data to a multiple"
            )
        return self


def _hf_config(model: ModelSection):
    from transformers import AutoConfig

    if model.pretrained is not None:
        check_local_path(model.pretrained, "model.pretrained")
        try:
            config = AutoConfig.from_pretrained(model.pretrained)
        except (OSError, ValueError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(
                f"model.pretrained: {model.pretrained} is not a save_pretrained directory ({first})"
            ) from None
        check_weights_dir(model.pretrained, "model.pretrained")  # a config alone would fail in every rank
        return config
    cfg = dict(model.config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("model.config must name its model_type (e.g. qwen3, llama)")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except ValueError as err:
        raise ValueError(f"model.config.model_type: {str(err).splitlines()[0]}") from None


def preflight(recipe: BDLMRecipe, world_size: int) -> None:
    """Every one-line error we can raise before a process starts: degrees, block counts, the vocab, and
    whether the model's attention can be routed (checked on a meta-device instance, no weights)."""
    from transformers import AutoModelForCausalLM

    if recipe.train.output_dir is not None:  # in the launcher, before any rank starts (the ranks check it again)
        check_writable_dir(recipe.train.output_dir, "train.output_dir")
    _, cp = recipe.parallel.degrees(world_size)
    mode = recipe.parallel.mode if cp > 1 else "reference"
    try:
        check_bdlm_shape(mode, recipe.data.max_length, recipe.model.block_size, cp)
    except ValueError as err:
        raise ValueError(f"data.max_length / model.block_size vs parallel.cp_degree: {err}") from None
    config = _hf_config(recipe.model)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    check_routable(lm)
    check_windows(config, recipe.model.block_size, recipe.data.max_length)
    coef = recipe.objective.router_aux_loss_coef
    if coef and not any(getattr(config, f, None) for f in ("num_experts", "num_local_experts")):
        name = type(lm).__name__
        raise ValueError(f"objective.router_aux_loss_coef: {name} has no mixture-of-experts router")
    vocab = min(lm.get_input_embeddings().num_embeddings, lm.get_output_embeddings().out_features)
    if not 0 <= recipe.objective.mask_token_id < vocab:
        raise ValueError(
            f"objective.mask_token_id must be in [0, {vocab}) (the vocab); "
            f"got {recipe.objective.mask_token_id}"
        )
    if recipe.data.pad_token_id >= vocab:
        raise ValueError(f"data.pad_token_id must be in [0, {vocab}); got {recipe.data.pad_token_id}")


def build_workload(recipe: BDLMRecipe) -> BDLMWorkload:
    m, d, o = recipe.model, recipe.data, recipe.objective
    config = _hf_config(m)

    def make_model() -> BDLMModel:
        kw = dict(block_size=m.block_size, clean_within_block=m.clean_within_block)
        if m.pretrained is not None:
            return BDLMModel.from_pretrained(m.pretrained, **kw)
        return BDLMModel.from_config(config, **kw)

    vocab = config.vocab_size
    if o.kind == "sft":
        objective = SFTObjective(
            m.block_size,
            o.mask_token_id,
            vocab,
            eps=o.eps,
            noise=o.noise or "stratified",
            weighting=o.weighting,
            denominator=o.denominator,
        )
    else:
        objective = ConvertObjective(
            m.block_size, o.mask_token_id, vocab, eps=o.eps, noise=o.noise or "uniform"
        )
    if d.source == "synthetic":
        source = SyntheticSource(
            vocab_size=vocab,
            seq_len=d.max_length,
            prompt_len=d.prompt_len,
            reserved=(o.mask_token_id, d.pad_token_id),
            seed=recipe.train.seed,
        )
    else:
        source = JsonlSource(d.path, seq_len=d.max_length, pad_token_id=d.pad_token_id, vocab_size=vocab)
    return BDLMWorkload(
        make_model=make_model,
        objective=objective,
        source=source,
        seq_len=d.max_length,
        exclude_mask_from_softmax=o.exclude_mask_from_softmax,
        ce_chunk_size=o.ce_chunk_size,
        router_aux_loss_coef=o.router_aux_loss_coef,
        router_aux_tokens=o.router_aux_tokens,
    )
