"""The plugin's algorithms, through SpecForge's registration contract (`AlgorithmSpec` + providers,
`make_registration`), added to SpecForge's built-in registry for one run:

    name           drafter (architectures in the draft config)            ranks per sample
    dflash-csbp    DFlash  (DFlashDraftModel / CSBPDFlashDraftModel)     cp_size (CSBP or CP)
    dflash2-csbp   DFlash2 (DFlash2DraftModel)                            cp_size (CSBP or CP)
    dflash2        DFlash2 (DFlash2DraftModel)                            1 (plain data parallel)

All three are offline (this project's feature store); SpecForge's online path streams whole-sequence
records to every consumer rank, which is what long contexts cannot afford (docs/specforge.md).
The registry is built per run because the providers carry the run's CSBP options (mode, objective knobs);
the spec itself stays pure data, as SpecForge requires.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any

import torch
from torch import nn

from ..data.capture import has_weights, random_target
from ..data.manifest import config_hash
from ..data.store import FeatureStore
from ..export.checkpoint import load_drafter_state
from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
from ..objectives.dflash import DFlashObjective
from .data import (
    FEATURE,
    NORMALIZER_ID,
    STORAGE_FORMAT,
    build_collator,
    build_normalizer,
    build_reader,
    check_store_path,
)
from .drafts import CSBP_DFLASH_KEY, DFLASH2_KEY, register_drafts, to_dflash_config
from .options import CSBPOptions, attention_options, compiles_drafter
from .training_model import CSBPDrafterTrainingModel

__all__ = ["ALGORITHMS", "algorithm_spec", "plugin_registrations", "plugin_registry", "trained_target"]

#: name -> (draft registry key, architectures accepted in the draft config, exported architecture)
ALGORITHMS = {
    "dflash-csbp": (CSBP_DFLASH_KEY, (CSBP_DFLASH_KEY, "DFlashDraftModel"), "DFlashDraftModel"),
    "dflash2-csbp": (DFLASH2_KEY, (DFLASH2_KEY,), "DFlash2DraftModel"),
    "dflash2": (DFLASH2_KEY, (DFLASH2_KEY,), "DFlash2DraftModel"),
}
_VOLATILE = ("transformers_version", "_name_or_path", "_attn_implementation_autoset", "torch_dtype", "dtype")


def algorithm_spec(name: str):
    from specforge.algorithms.contracts import (
        AlgorithmCapabilities,
        AlgorithmSpec,
        DraftRequirement,
        FeatureContract,
        FeatureMode,
        OfflineStorageContract,
    )

    key, accepted, _ = ALGORITHMS[name]
    tensors = {FEATURE}
    return AlgorithmSpec(
        name=name,
        draft=DraftRequirement(compatible_architectures=set(accepted), default_architecture=key),
        feature_contracts=(
            FeatureContract(
                mode=FeatureMode.OFFLINE,
                modality="text",
                required_tensors=tensors,
                storage=OfflineStorageContract(
                    format=STORAGE_FORMAT, required_tensors=tensors, normalizer=NORMALIZER_ID
                ),
            ),
        ),
        capabilities=AlgorithmCapabilities(attention_backends={"eager", "sdpa", "flex_attention"}),
    )


# -- model providers ---------------------------------------------------------------------------------
def _device():
    from specforge.utils import get_local_device

    return get_local_device()


def _dtype(cfg):
    return getattr(torch, cfg.model.torch_dtype)


def _mask_token_id(cfg, config) -> int:
    """dflash_config.mask_token_id, else model.mask_token_id, else the target tokenizer's <|MASK|>."""
    if config.dflash.get("mask_token_id") is not None:
        return int(config.dflash["mask_token_id"])
    if cfg.model.mask_token_id is not None:
        return int(cfg.model.mask_token_id)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            cfg.model.target_model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        token_id = tok.convert_tokens_to_ids("<|MASK|>")
        if isinstance(token_id, int) and token_id != tok.unk_token_id:
            return token_id
    except Exception:  # noqa: BLE001, S110 - no usable tokenizer: the error below says what to set
        pass
    raise ValueError(
        "dflash_config.mask_token_id: missing in model.draft_model_config, model.mask_token_id is unset and the "
        "target tokenizer has no <|MASK|> token; set one of them"
    )


def build_draft(name: str, cfg, draft_config):
    register_drafts()
    architecture = ALGORITHMS[name][2]
    config = to_dflash_config(draft_config, architecture)
    dflash = config.dflash
    dflash["mask_token_id"] = _mask_token_id(cfg, config)
    config.dflash_config = dflash
    cls = DFlash2DraftModel if architecture == "DFlash2DraftModel" else DFlashDraftModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training.seed)  # same initial drafter on every rank and in every layout
        model = cls(config)
    if cfg.model.draft_checkpoint_path:
        state = load_drafter_state(cfg.model.draft_checkpoint_path)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"model.draft_checkpoint_path: weights do not fit the drafter config "
                f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})"
            )
    return model.to(device=_device(), dtype=_dtype(cfg))


def _frozen_target_parts(cfg, target_config, manifest):
    """(embed_tokens, lm_head) of the target, frozen: from its checkpoint, or rebuilt from the seed of a
    randomly initialised target the store was captured from."""
    path = cfg.model.target_model_path
    if has_weights(path) or not os.path.exists(path):
        from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

        parts = TargetEmbeddingsAndHead.from_pretrained(
            path, embed_key=cfg.model.embedding_key, lm_head_key=cfg.model.lm_head_key,
            cache_dir=cfg.model.cache_dir, device=_device().type, dtype=_dtype(cfg),
            trust_remote_code=cfg.model.trust_remote_code,
        )  # fmt: skip
        return parts.embed_tokens, parts.lm_head
    seed = manifest.target.random_init_seed
    if seed is None:
        raise ValueError(
            f"model.target_model_path={path} has no weights and the feature store was not captured from a "
            "randomly initialised target; point it at the target checkpoint"
        )
    target = random_target(target_config, seed, "float32")
    embed = nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach().clone(), freeze=True)
    head_w = target.get_output_embeddings().weight.detach().clone()
    head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(head_w)
    del target
    return embed.to(_device(), _dtype(cfg)), head.to(_device(), _dtype(cfg))


def objective_for(cfg, options: CSBPOptions, block_size: int):
    blocks = cfg.training.objective_chunk_blocks
    return DFlashObjective(
        num_anchors=cfg.training.num_anchors, sampling=options.anchor_sampling,
        loss_type=cfg.training.loss_type,
        gamma=cfg.training.loss_decay_gamma, dpace_alpha=cfg.training.dpace_alpha,
        selector_alpha=options.selector_alpha, selector_warmup_steps=options.selector_warmup_steps,
        chunk_size=blocks * block_size if blocks > 0 else 1 << 30, seed=cfg.training.seed,
        keep_logits_gib=options.keep_logits_gib,
    )  # fmt: skip


def build_training_model(
    name: str, options: CSBPOptions, cfg, draft_model, draft_config, target_config, tokenizer
):
    from specforge.algorithms.model_providers import AlgorithmModelParts


    ids, hidden = list(draft_model.target_layer_ids), int(draft_model.config.hidden_size)

    def open_checked(path: str, field: str):
        check_store_path(path, field)
        store = FeatureStore(path, verify="trust")
        if store.target_layer_ids != ids:
            raise ValueError(
                f"{field}: the feature store holds target layers {store.target_layer_ids} but "
                f"model.draft_model_config needs dflash_config.target_layer_ids {ids}; capture the store with these layers"
            )
        store.check_compatible(ids, hidden)
        captured = store.manifest.target.config_sha256
        if captured is not None and captured != config_hash(target_config):
            raise ValueError(
                f"model.target_model_path={cfg.model.target_model_path}: its config is not the one the feature store "
                f"({field}) was captured from"
            )
        return store

    path = cfg.data.hidden_states_path
    store = open_checked(path, "data.hidden_states_path")
    eval_path = cfg.data.eval_hidden_states_path or None
    if eval_path is not None:  # SpecForge's eval loader reads it through the same reader (plugin/data.py)
        open_checked(eval_path, "data.eval_hidden_states_path")
    embed, head = _frozen_target_parts(cfg, target_config, store.manifest)
    if embed.weight.shape[1] != hidden:
        raise ValueError(
            f"model.draft_model_config: hidden_size {hidden} != the target's hidden size {embed.weight.shape[1]} "
            "(a DFlash drafter shares the target's embedding and LM head)"
        )
    mode = options.mode if name.endswith("-csbp") else "dp"
    model = CSBPDrafterTrainingModel(
        draft_model, embed, head, store_path=path,
        objective=objective_for(cfg, options, int(draft_model.block_size)),
        mode=mode, max_len=cfg.data.max_length, bucket=options.bucket,
        attention=attention_options(options, cfg.training.attention_backend),
        prefetch_features=options.prefetch_features, eval_store_path=eval_path,
        store_verify=options.store_verify,
    ).to(device=_device())  # fmt: skip
    if compiles_drafter(options, _device()):
        compiled = draft_model.compile_token_wise()
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"specforge-csbp: csbp.compile -> the drafter's token-wise chains compiled ({compiled} modules)", flush=True)
    return AlgorithmModelParts(model=model, capture_layers=ids)


def resolve_capture_layers(cfg, draft_config, target_config):
    ids = (getattr(draft_config, "dflash_config", None) or {}).get("target_layer_ids")
    if not ids:
        raise ValueError("model.draft_model_config: dflash_config.target_layer_ids is missing")
    return list(ids)


# -- step provider ------------------------------------------------------------------------------------
def build_step(name: str, wrapped_model, *, target_head=None, **_options):
    from .strategy import CSBPDraftTrainStrategy  # lazy: strategy.py imports SpecForge (optional dependency)

    return CSBPDraftTrainStrategy(wrapped_model, name=name)


def draft_config_json(config) -> str:
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    return json.dumps(data, sort_keys=True, default=str)


def trained_target(target, target_path: str | None) -> str:
    """JSON of the target this run's drafter is trained for: the config hash and weights fingerprint the
    feature store recorded (`target`, its manifest's TargetInfo: the features' source; preflight checked
    model.target_model_path against them), the fingerprint of `target_path` (model.target_model_path) where
    the store has none. Saved in every checkpoint (`csbp_target`) and copied into every export's provenance,
    so export and eval compare a drafter with the target they are given (compat.check_drafter_target)."""
    from ..data.fingerprint import weights_fingerprint  # lazy: reads the target's weight files

    weights = target.weights_sha256 or weights_fingerprint(target_path)
    return json.dumps({"config_sha256": target.config_sha256, "weights_sha256": weights}, sort_keys=True)


def resume_contract(name: str, cfg, draft_model, training_model) -> dict[str, Any]:
    """What a checkpoint must agree on to resume (the layout - cp size, dp replicas - may change)."""
    from .checkpoints import saved_state_has  # lazy: reads the resumed checkpoint

    objective = training_model.objective
    contract = {
        "csbp_algorithm": name,
        "csbp_draft_config": draft_config_json(draft_model.config),
        "csbp_objective": json.dumps(
            {k: getattr(objective, k) for k in objective.__dataclass_fields__}, sort_keys=True
        ),
        # the store the training model reads (opened once there), not a second parse of its manifest
        "csbp_target": trained_target(training_model.store.manifest.target, cfg.model.target_model_path),
    }
    resumed = cfg.training.resume_from
    if resumed and saved_state_has(resumed, "csbp_target") is False:
        # a checkpoint written before the target was recorded: SpecForge would refuse a contract key the
        # checkpoint lacks, so such a run resumes as it was written (its exports carry no target to compare)
        del contract["csbp_target"]
    return contract


def plugin_registrations(options: CSBPOptions | None = None):
    from specforge.algorithms.common.providers import (
        AlgorithmProviders,
        DraftConfigProvider,
        ModelProvider,
        OfflineDataProvider,
        StepProvider,
        make_registration,
    )

    options = options or CSBPOptions()
    out = []
    for name, (key, accepted, _) in ALGORITHMS.items():
        offline = OfflineDataProvider(
            modality="text", normalizer_id=NORMALIZER_ID, build_reader=partial(build_reader, name),
            build_normalizer=build_normalizer, build_collator=build_collator,
        )  # fmt: skip
        providers = AlgorithmProviders(
            algorithm_name=name,
            step=StepProvider(
                build=partial(build_step, name),
                options=lambda cfg: {},
                resume_contract=partial(resume_contract, name),
                allowed_missing_checkpoint_keys=lambda *_: frozenset(),
                uses_external_target_head=False,
            ),
            model=ModelProvider(
                draft_config=DraftConfigProvider(
                    architecture=key, compatible_architectures=frozenset(accepted)
                ),
                build_draft=partial(build_draft, name),
                build_training_model=partial(build_training_model, name, options),
                resolve_capture_layers=resolve_capture_layers,
                minimum_loss_tokens=lambda cfg, draft_config: 2,
                needs_input_tools=lambda cfg, draft_model: False,
                # loader threads keep two batches materialised ahead: the look-ahead (plugin/lookahead.py)
                # takes batch k + 1 when k is due, so one thread would fetch it right then, on the clock
                # (data.dataloader_num_workers overrides)
                default_dataloader_num_workers=2,
            ),
            offline=(offline,),
        )
        out.append(make_registration(algorithm_spec(name), providers))
    return tuple(out)


def plugin_registry(options: CSBPOptions | None = None):
    """SpecForge's built-in algorithms plus this plugin's (registers the drafters, too)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry

    register_drafts()
    registry = builtin_algorithm_registry()
    for registration in plugin_registrations(options):
        registry = registry.with_registration(registration)
    return registry
