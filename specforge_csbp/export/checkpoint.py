"""Read a trained drafter out of a checkpoint, whatever wrote it.

    accepted CHECKPOINT                                     found there
    <output_dir>                  (SpecForge run root)      <run_id>-latest -> <run_id>-stepN/training_state.pt
    <output_dir>/<run_id>-stepN   (SpecForge checkpoint)    training_state.pt: strategy, draft_state_dict,
    .../training_state.pt                                   csbp_draft_config (the plugin's resume contract)
    <dir with config.json + model.safetensors>              a saved drafter (save_pretrained, an export,
    <output_dir> with `latest` -> step_N/ (specforge-csbp)  or this project's own trainer)

Anything else - a SpecForge checkpoint of a stock strategy (`dflash`, `eagle3`, ...), an EAGLE drafter, a
target model - is refused in one line that says what it is.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import load_json
from ..models.dflash.configuration import DFlashConfig
from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

__all__ = ["DrafterCheckpoint", "load_checkpoint", "load_drafter_state", "resolve_source"]

STATE_FILE = "training_state.pt"
_PLUGIN_STRATEGIES = ("dflash-csbp", "dflash2-csbp", "dflash2")
_ARCHES = ("DFlashDraftModel", "DFlash2DraftModel")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class DrafterCheckpoint:
    source: str  # the file the weights came from (hashed into the provenance)
    kind: str  # "specforge" | "pretrained"
    config: Any  # DFlashConfig
    state_dict: dict[str, torch.Tensor]
    strategy: str | None = None
    global_step: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.config.architecture


def _latest_specforge_state(root: str) -> str | None:
    states = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(glob.escape(root), "*-latest"))})
    states = [s for s in states if os.path.isfile(os.path.join(s, STATE_FILE))]
    if len(states) > 1:
        raise ValueError(
            f"CHECKPOINT: {root} holds several runs ({', '.join(states)}); name one checkpoint directory"
        )
    return os.path.join(states[0], STATE_FILE) if states else None


def resolve_source(path: str) -> tuple[str, str]:
    """(kind, path): ('specforge', training_state.pt) or ('pretrained', directory)."""
    if not os.path.exists(path):
        raise ValueError(f"CHECKPOINT: {path} does not exist")
    if os.path.isfile(path):
        if os.path.basename(path) == STATE_FILE:
            return "specforge", path
        raise ValueError(f"CHECKPOINT: {path} is a file but not a SpecForge {STATE_FILE}")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return "specforge", os.path.join(path, STATE_FILE)
    if os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.isfile(os.path.join(path, w)) for w in _WEIGHT_FILES
    ):
        return "pretrained", path
    latest = _latest_specforge_state(path)
    if latest is not None:
        return "specforge", latest
    pointer = os.path.join(path, "latest")
    if os.path.isfile(pointer):  # specforge-csbp's own trainer
        return resolve_source(os.path.join(path, open(pointer).read().strip()))
    raise ValueError(
        f"CHECKPOINT: {path} is not a drafter checkpoint (no {STATE_FILE}, no *-latest run, "
        "no config.json + model.safetensors)"
    )


def _config_from_dict(data: dict, where: str):
    archs = data.get("architectures") or []
    if len(archs) != 1 or archs[0] not in _ARCHES + ("CSBPDFlashDraftModel",):
        raise ValueError(
            f"CHECKPOINT: {where} is not a CSBP drafter (architectures {archs}; expected one of {', '.join(_ARCHES)})"
        )
    data = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version", "auto_map")}
    if archs[0] == "CSBPDFlashDraftModel":
        data["architectures"] = ["DFlashDraftModel"]
    config = DFlashConfig(**data)
    config.validate_dflash()
    return config


def _load_specforge(path: str) -> DrafterCheckpoint:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise ValueError(f"CHECKPOINT: cannot read {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise ValueError(f"CHECKPOINT: {path} holds no draft_state_dict")  # noqa: TRY004
    strategy = state.get("strategy")
    if strategy not in _PLUGIN_STRATEGIES or "csbp_draft_config" not in state:
        raise ValueError(
            f"CHECKPOINT: {path} was written by SpecForge strategy {strategy!r}, not a CSBP drafter "
            f"({', '.join(_PLUGIN_STRATEGIES)}); export stock checkpoints with `specforge export`"
        )
    config = _config_from_dict(json.loads(state["csbp_draft_config"]), path)
    extra = {k: state[k] for k in ("csbp_algorithm", "csbp_objective", "run_id", "world_size") if k in state}
    return DrafterCheckpoint(
        source=path, kind="specforge", config=config, state_dict=state["draft_state_dict"], strategy=strategy,
        global_step=int(state.get("global_step", 0)), extra=extra,
    )  # fmt: skip


def _load_pretrained(path: str) -> DrafterCheckpoint:
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    config = _config_from_dict(load_json(config_path, "CHECKPOINT"), config_path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(load_json(index, "CHECKPOINT")["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(os.path.join(path, name)))
        source = index
    else:
        source = os.path.join(path, "model.safetensors")
        state = load_file(source)
    return DrafterCheckpoint(source=source, kind="pretrained", config=config, state_dict=state)


def load_checkpoint(path: str) -> DrafterCheckpoint:
    kind, where = resolve_source(path)
    ckpt = _load_specforge(where) if kind == "specforge" else _load_pretrained(where)
    _check_weights(ckpt)
    return ckpt


def _check_weights(ckpt: DrafterCheckpoint) -> None:
    """The weights must be exactly the drafter's parameters (a CSBP drafter, not something else)."""
    cls = DFlash2DraftModel if ckpt.architecture == "DFlash2DraftModel" else DFlashDraftModel
    with torch.device("meta"):
        model = cls(ckpt.config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ckpt.state_dict.items()}
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
    if missing or unexpected or wrong:
        raise ValueError(
            f"CHECKPOINT: {ckpt.source} does not hold a {ckpt.architecture} of its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shapes {wrong[:3]})"
        )


def load_drafter_state(path: str) -> dict[str, torch.Tensor]:
    """Drafter weights for a warm start (model.draft_checkpoint_path)."""
    kind, where = resolve_source(path)
    ckpt = _load_specforge(where) if kind == "specforge" else _load_pretrained(where)
    return ckpt.state_dict
