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
from ..preflight import check_finite_tensors, check_input_file
from ..models.dflash.configuration import DFlashConfig
from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

__all__ = ["DrafterCheckpoint", "load_checkpoint", "load_drafter_state", "resolve_source"]

STATE_FILE = "training_state.pt"
_PLUGIN_STRATEGIES = ("dflash-csbp", "dflash2-csbp", "dflash2")
_ARCHES = ("DFlashDraftModel", "DFlash2DraftModel")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# what a drafter config must state (a default would silently describe another model)
_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


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

    @property
    def trained_for(self) -> dict[str, Any]:
        """The target facts this drafter was trained for (compat's names), as far as its checkpoint records
        them: a plugin checkpoint and its exports do (`csbp_target`), other drafters do not ({})."""
        target = self.extra.get("csbp_target") or {}
        return {"target_config_sha256": target.get("config_sha256"),
                "target_weights_sha256": target.get("weights_sha256")}  # fmt: skip


def _latest_specforge_state(root: str, field: str = "CHECKPOINT") -> str | None:
    states = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(glob.escape(root), "*-latest"))})
    states = [s for s in states if os.path.isfile(os.path.join(s, STATE_FILE))]
    if len(states) > 1:
        raise ValueError(
            f"{field}: {root} holds several runs ({', '.join(states)}); name one checkpoint directory"
        )
    return os.path.join(states[0], STATE_FILE) if states else None


def resolve_source(path: str, field: str = "CHECKPOINT") -> tuple[str, str]:
    """(kind, path): ('specforge', training_state.pt) or ('pretrained', directory). `field` names the flag."""
    if not os.path.exists(path):
        raise ValueError(f"{field}: {path} does not exist")
    if os.path.isfile(path):
        if os.path.basename(path) == STATE_FILE:
            return "specforge", path
        raise ValueError(
            f"{field}: {path} is a file but not a SpecForge {STATE_FILE}; give a checkpoint or export directory"
        )
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return "specforge", os.path.join(path, STATE_FILE)
    if os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.isfile(os.path.join(path, w)) for w in _WEIGHT_FILES
    ):
        return "pretrained", path
    latest = _latest_specforge_state(path, field)
    if latest is not None:
        return "specforge", latest
    pointer = os.path.join(path, "latest")
    if os.path.isfile(pointer):  # specforge-csbp's own trainer
        return resolve_source(os.path.join(path, open(pointer).read().strip()), field)
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        raise ValueError(
            f"{field}: {path} has a config.json but no weights (model.safetensors or its index); a drafter "
            "directory needs both"
        )
    raise ValueError(
        f"{field}: {path} is not a drafter checkpoint (no {STATE_FILE}, no *-latest run, "
        "no config.json + model.safetensors)"
    )


def _config_from_dict(data: dict, where: str, field: str = "CHECKPOINT"):
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {where} must hold a JSON object (a drafter config)")  # noqa: TRY004
    archs = data.get("architectures") or []
    if len(archs) != 1 or archs[0] not in _ARCHES + ("CSBPDFlashDraftModel",):
        hint = ""
        if any(isinstance(a, str) and a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs):
            hint = " - it is a target model; was it given in place of the drafter (swapped arguments)?"
        raise ValueError(
            f"{field}: {where} is not a CSBP drafter (architectures {archs}; expected one of "
            f"{', '.join(_ARCHES)}){hint}"
        )
    missing = [k for k in _SHAPE_FIELDS if k not in data]
    if missing:  # the class defaults would build another drafter, and its weights would not fit
        raise ValueError(
            f"{field}: {where} has no {', '.join(missing)}; a drafter config names its shapes "
            f"({', '.join(_SHAPE_FIELDS)})"
        )
    data = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version", "auto_map")}
    if archs[0] == "CSBPDFlashDraftModel":
        data["architectures"] = ["DFlashDraftModel"]
    try:
        config = DFlashConfig(**data)
        config.validate_dflash()
    except (TypeError, KeyError, AttributeError) as err:  # a missing or mistyped field of the config
        raise ValueError(f"{field}: {where} is not a usable drafter config ({type(err).__name__}: {err})") from None
    except ValueError as err:
        raise ValueError(f"{field}: {where}: {err}") from None
    return config


def _load_specforge(path: str, field: str = "CHECKPOINT") -> DrafterCheckpoint:
    if os.path.getsize(path) == 0:
        raise ValueError(f"{field}: {path} is empty (0 bytes); re-copy it or take another checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise ValueError(f"{field}: cannot read {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise ValueError(f"{field}: {path} holds no draft_state_dict")  # noqa: TRY004
    strategy = state.get("strategy")
    if strategy not in _PLUGIN_STRATEGIES or "csbp_draft_config" not in state:
        raise ValueError(
            f"{field}: {path} was written by SpecForge strategy {strategy!r}, not a CSBP drafter "
            f"({', '.join(_PLUGIN_STRATEGIES)}); export stock checkpoints with `specforge export`"
        )
    config = _config_from_dict(json.loads(state["csbp_draft_config"]), path, field)
    extra = {k: state[k] for k in ("csbp_algorithm", "csbp_objective", "run_id", "world_size") if k in state}
    if isinstance(state.get("csbp_target"), str):
        extra["csbp_target"] = json.loads(state["csbp_target"])
    return DrafterCheckpoint(
        source=path, kind="specforge", config=config, state_dict=state["draft_state_dict"], strategy=strategy,
        global_step=int(state.get("global_step", 0)), extra=extra,
    )  # fmt: skip


def _safetensors(path: str, field: str) -> dict[str, torch.Tensor]:
    """One safetensors file; a missing, empty or truncated one is a line naming the file and the flag."""
    from safetensors.torch import load_file

    check_input_file(path, field)
    if os.path.getsize(path) == 0:
        raise ValueError(f"{field}: {path} is empty (0 bytes); re-copy or re-save the weights")
    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 - SafetensorError and friends: the file is not a whole one
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"{field}: {path}: a weights file is not a complete safetensors file ({first}); re-copy or re-save it"
        ) from None


def _load_pretrained(path: str, field: str = "CHECKPOINT") -> DrafterCheckpoint:
    config_path = os.path.join(path, "config.json")
    config = _config_from_dict(load_json(config_path, field), config_path, field)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = load_json(index, field)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise ValueError(f"{field}: {index} has no weight_map (a safetensors index maps names to files)")
        state: dict[str, torch.Tensor] = {}
        for name in sorted(set(map(str, weight_map["weight_map"].values()))):
            state.update(_safetensors(os.path.join(path, name), field))
        source = index
    else:
        source = os.path.join(path, "model.safetensors")
        state = _safetensors(source, field)
    return DrafterCheckpoint(source=source, kind="pretrained", config=config, state_dict=state,
                             extra=_exported_target(path))  # fmt: skip


def _exported_target(path: str) -> dict[str, Any]:
    """{'csbp_target': ...} from an export's provenance.json (export/writer.py copies the checkpoint's), or {}."""
    provenance = os.path.join(path, "provenance.json")
    if not os.path.isfile(provenance):
        return {}
    try:
        with open(provenance, encoding="utf-8") as f:
            source = json.load(f).get("source") or {}
    except (OSError, ValueError, AttributeError):  # provenance is a record, not an input: unreadable = absent
        return {}
    target = source.get("csbp_target") if isinstance(source, dict) else None
    return {"csbp_target": target} if isinstance(target, dict) else {}


def _read(path: str, field: str) -> DrafterCheckpoint:
    kind, where = resolve_source(path, field)
    ckpt = _load_specforge(where, field) if kind == "specforge" else _load_pretrained(where, field)
    check_finite_tensors(ckpt.state_dict, field, ckpt.source)  # a NaN weight would still "work" downstream
    return ckpt


def load_checkpoint(path: str, field: str = "CHECKPOINT") -> DrafterCheckpoint:
    """The drafter at `path` (any form the table above lists), its weights checked: exactly the drafter's
    parameters, every value finite. `field` is the flag or config field that named it (in every error)."""
    ckpt = _read(path, field)
    _check_weights(ckpt, field)
    return ckpt


def _check_weights(ckpt: DrafterCheckpoint, field: str = "CHECKPOINT") -> None:
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
            f"{field}: {ckpt.source} does not hold a {ckpt.architecture} of its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shapes {wrong[:3]})"
        )


def load_drafter_state(path: str, field: str = "model.draft_checkpoint_path") -> dict[str, torch.Tensor]:
    """Drafter weights for a warm start (model.draft_checkpoint_path), every value finite."""
    return _read(path, field).state_dict
