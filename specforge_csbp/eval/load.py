"""Load a drafter and its target for evaluation, and refuse a pair that does not fit, in one line each.

Drafters come through export/checkpoint.py's `load_checkpoint` - a training output directory (its latest
checkpoint), one checkpoint, or an exported SGLang / HF directory: the export writes the model's own
parameter names (SGLang's), so one loader and one name set serve all of them. `untrained=True` keeps the
config and draws fresh weights (seeded): the baseline a trained drafter is compared with.
"""

from __future__ import annotations

import os

import torch

from ..compat import check_drafter_target, read_target_config
from ..data.capture import load_target
from ..export.checkpoint import load_checkpoint
from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
from .choices import DTYPES

__all__ = [
    "DTYPES",
    "check_pair",
    "check_positions",
    "load_drafter",
    "load_eval_target",
    "load_target_config",
    "resolve_dtype",
]



def resolve_dtype(dtype: str, device: torch.device) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return dtype


def load_drafter(path: str, *, untrained: bool = False, seed: int = 0, dtype: str, device: torch.device):
    """(model, DrafterCheckpoint) on `device` in `dtype`, in eval mode."""
    if not os.path.exists(path):
        raise ValueError(f"--drafter: {path} does not exist")
    ckpt = load_checkpoint(path, "--drafter")
    cls = DFlash2DraftModel if ckpt.architecture == "DFlash2DraftModel" else DFlashDraftModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(ckpt.config)
    if not untrained:
        model.load_state_dict(ckpt.state_dict, strict=True)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval(), ckpt


def load_target_config(path: str):
    """The target's config alone (the pair checks run before any weight is read)."""
    return read_target_config(path, "--target")


def load_eval_target(path: str, *, dtype: str, device: torch.device, seed: int = 0):
    """A transformers causal LM (sdpa attention); a directory with a config but no weights gets the seeded
    random weights `specforge-csbp capture` uses for it."""
    if not os.path.exists(path):
        raise ValueError(f"--target: {path} does not exist")
    model, _ = load_target(path, dtype=dtype, device=str(device), seed=seed)
    return model


def check_pair(
    drafter_config, target_config, drafter: str = "--drafter", target: str = "--target", *,
    trained_for: dict | None = None, target_path: str | None = None,
) -> None:  # fmt: skip
    """The drafter must read this target (compat.check_drafter_target: one check for every command);
    `trained_for` / `target_path`: the target its checkpoint records, and the target's directory."""
    check_drafter_target(drafter_config, target_config, drafter, target, trained_for=trained_for,
                         target_path=target_path)  # fmt: skip


def check_positions(prompts, max_new_tokens: int, block_size: int, target_config) -> None:
    """Every token must be in the target's vocabulary, and every position a run can reach (the last verify
    block included) one the target has."""
    text = target_config.get_text_config()
    vocab = int(text.vocab_size)
    for i, prompt in enumerate(prompts):
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if bad.numel():
            raise ValueError(
                f"prompt {i}: token id {int(bad[0])} is outside the target's vocabulary 0..{vocab - 1}"
            )
    limit = getattr(text, "max_position_embeddings", None)
    if limit is None:
        return
    for i, prompt in enumerate(prompts):
        need = int(prompt.shape[0]) + max_new_tokens + block_size - 1
        if need > int(limit):
            raise ValueError(
                f"prompt {i}: {int(prompt.shape[0])} tokens + --max-new-tokens {max_new_tokens} + block_size "
                f"{block_size} - 1 = {need} positions exceed the target's max_position_embeddings = {limit}"
            )
