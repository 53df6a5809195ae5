"""The drafter classes in SpecForge's draft registry (`@register_draft`), keyed by the architecture name a
draft-config JSON carries in `architectures`.

    architectures          registry key            class built for training
    DFlash2DraftModel      DFlash2DraftModel       specforge_csbp DFlash2DraftModel
    DFlashDraftModel       (SpecForge's own)       config accepted by `dflash-csbp`, built as:
                           CSBPDFlashDraftModel    specforge_csbp DFlashDraftModel

SpecForge 0.2.0 registers its own `DFlashDraftModel`, so this project's DFlash class is registered under
`CSBPDFlashDraftModel`; `dflash-csbp` accepts configs naming either. Exports always carry SGLang's names
(`DFlashDraftModel` / `DFlash2DraftModel`).
"""

from __future__ import annotations

from ..models.dflash.configuration import DFlashConfig
from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

__all__ = ["CSBP_DFLASH_KEY", "DFLASH2_KEY", "register_drafts", "to_dflash_config"]

CSBP_DFLASH_KEY = "CSBPDFlashDraftModel"
DFLASH2_KEY = "DFlash2DraftModel"


def register_drafts() -> dict[str, type]:
    """Idempotent. Returns {registry key: class}."""
    import specforge.modeling.draft  # noqa: F401  (registers SpecForge's built-ins first)
    from specforge.modeling.draft.registry import DRAFT_REGISTRY, register_draft

    wanted = {CSBP_DFLASH_KEY: DFlashDraftModel, DFLASH2_KEY: DFlash2DraftModel}
    for key, cls in wanted.items():
        if DRAFT_REGISTRY.get(key) is not cls:
            register_draft(cls, name=key)
    return wanted


def to_dflash_config(draft_config, architecture: str):
    """Any draft config (SpecForge's DFlash config class, or ours) as this project's DFlashConfig."""
    payload = draft_config.to_dict() if hasattr(draft_config, "to_dict") else dict(draft_config)
    for key in ("model_type", "transformers_version", "auto_map", "_attn_implementation_autoset"):
        payload.pop(key, None)
    payload["architectures"] = [architecture]
    config = DFlashConfig(**payload)
    return config
