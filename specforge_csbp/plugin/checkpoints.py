"""Checkpoint-vs-config checks of the drafter launcher, before any worker starts.

A warm start (`model.draft_checkpoint_path`) or a resume (`training.resume_from`) from a drafter of another
shape fails inside the workers with a `load_state_dict` dump or a whole-config comparison; here the
checkpoint's drafter config is compared field by field with `model.draft_model_config`, and the first field
that differs is named:

    model.draft_checkpoint_path: its drafter has num_hidden_layers=2, model.draft_model_config has 1; ...

Where the checkpoint keeps its config: a pretrained directory's config.json, or a SpecForge checkpoint's
`training_state.pt` (`csbp_draft_config`, the plugin's resume contract; read memory-mapped). The weights a
warm start or a resume would load are checked finite too (preflight.check_finite_tensors), naming the
tensor and the file: a NaN weight trains on as NaN losses from step 1.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import load_json
from ..export.checkpoint import load_drafter_state
from ..preflight import check_finite_tensors

__all__ = [
    "check_resume_config",
    "check_resume_target",
    "check_warm_start",
    "first_difference",
    "saved_draft_config",
    "saved_state_has",
]

# fields that do not change the drafter's function or shapes
_IGNORED = {"transformers_version", "_name_or_path", "_attn_implementation_autoset", "torch_dtype", "dtype",
            "_commit_hash", "use_cache"}  # fmt: skip


def first_difference(saved: dict, current: dict, prefix: str = "") -> tuple[str, Any, Any] | None:
    """(dotted key, saved value, current value) of the first key present in both that differs."""
    for key in sorted(set(saved) & set(current)):
        if key in _IGNORED:
            continue
        a, b = saved[key], current[key]
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, f"{name}.")
            if found:
                return found
        elif a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            return name, a, b
    return None


def _state_file(path: str) -> str | None:
    path = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    if os.path.isfile(path):
        return path if path.endswith(".pt") else None
    try:
        from specforge.training.checkpoint import STATE_FILE, CheckpointManager

        resolved = CheckpointManager.resolve_resume_dir(path)
    except Exception:  # noqa: BLE001 - not a SpecForge run root: SpecForge's own resolution reports it
        return None
    state = os.path.join(resolved, STATE_FILE)
    return state if os.path.isfile(state) else None


def _saved_state(path: str) -> dict | None:
    """A SpecForge checkpoint's training_state (memory-mapped), or None where `path` names none."""
    import torch

    state_file = _state_file(path)
    if state_file is None:
        return None
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - a damaged file: one line naming it
        raise ValueError(f"checkpoint {state_file} cannot be read: {str(err).splitlines()[0]}") from None
    return state if isinstance(state, dict) else None


def saved_state_has(path: str, key: str) -> bool | None:
    """Whether the SpecForge checkpoint at `path` records `key` (None: no such checkpoint to read)."""
    state = _saved_state(path)
    return None if state is None else key in state


def saved_draft_config(path: str) -> dict | None:
    """The drafter config a checkpoint was trained with, or None when it keeps none this can read."""
    local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    config = os.path.join(local, "config.json") if os.path.isdir(local) else None
    if config and os.path.isfile(config) and not os.path.isfile(os.path.join(local, "training_state.pt")):
        return load_json(config, "model.draft_checkpoint_path")
    state = _saved_state(path)
    text = state.get("csbp_draft_config") if state is not None else None
    return json.loads(text) if isinstance(text, str) else None


def _check_finite_resume(path: str) -> None:
    import torch

    state_file = _state_file(path)
    if state_file is None:
        return
    state = torch.load(state_file, map_location="cpu", weights_only=False, mmap=True)
    weights = state.get("draft_state_dict") if isinstance(state, dict) else None
    if isinstance(weights, dict):
        check_finite_tensors(weights, "training.resume_from", state_file)


def _check(path: str, field: str, draft: dict, action: str) -> None:
    saved = saved_draft_config(path)
    if saved is None:
        return
    diff = first_difference(saved, draft)
    if diff is not None:
        key, was, now = diff
        raise ValueError(
            f"{field}: its drafter has {key}={json.dumps(was)}, model.draft_model_config has {key}="
            f"{json.dumps(now)}; {action}"
        )


def check_warm_start(path: str, draft: dict) -> None:
    _check(path, "model.draft_checkpoint_path", draft,
           "warm-start from a drafter of this config, or change model.draft_model_config to match it")  # fmt: skip
    if os.path.exists(os.path.expanduser(path.removeprefix("file://"))):
        load_drafter_state(path, "model.draft_checkpoint_path")  # the workers' loader: readable, finite weights


def check_resume_config(path: str, draft: dict) -> None:
    _check(path, "training.resume_from", draft,
           "resume with the drafter config the checkpoint was trained with, or start a new run")  # fmt: skip
    _check_finite_resume(path)


def check_resume_target(path: str, current: str) -> None:
    """A resumed drafter must keep training for the target it was trained for: its checkpoint's `csbp_target`
    (registry.trained_target) against this run's (a checkpoint written before targets were recorded: not
    compared)."""
    state = _saved_state(path)
    saved = state.get("csbp_target") if state is not None else None
    if not isinstance(saved, str) or saved == current:
        return
    was, now = json.loads(saved), json.loads(current)
    for key, what in (("config_sha256", "config sha256"), ("weights_sha256", "weights fingerprint")):
        if None not in (was.get(key), now.get(key)) and was[key] != now[key]:
            raise ValueError(
                f"training.resume_from: its drafter was trained for a target with {what} {was[key][:12]}, this "
                f"run's target has {now[key][:12]}; resume with the target and feature store it was trained "
                "on, or start a new run"
            )
