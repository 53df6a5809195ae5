"""Tiny float64 target + drafters for the eval tests (no download: the quickstart's tiny Qwen3 config)."""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoConfig

from specforge_csbp.assets import TINY_TARGET_DIR
from specforge_csbp.data.capture import random_target
from specforge_csbp.models.dflash import make_dflash_config
from specforge_csbp.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

S = 4


def tiny_target(dtype: str = "float64"):
    return random_target(AutoConfig.from_pretrained(TINY_TARGET_DIR), seed=0, dtype=dtype).eval()


def drafter_config(dflash2: bool, **over):
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=3,
        block_size=S, layer_types=["sliding_attention", "full_attention"], sliding_window=6, dflash2=dflash2,
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4, max_position_embeddings=4096,
    )  # fmt: skip
    base.update(over)
    return make_dflash_config(**base)


def random_drafter(dflash2: bool, seed: int = 1, dtype=torch.float64, **over):
    """A drafter whose every weight is random (conv and selector included, unlike a fresh init)."""
    cls = DFlash2DraftModel if dflash2 else DFlashDraftModel
    torch.manual_seed(seed)
    model = cls(drafter_config(dflash2, **over))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2 if "conv" in name or "codebook" in name else 0.05)
    return model.to(dtype).eval()


def write_drafter_dir(model, path: str) -> str:
    model.save_pretrained(path)
    return path


def write_training_output(model, root: str, step: int = 2) -> str:
    """A SpecForge run root as the plugin writes it: <run>-stepN/training_state.pt and <run>-latest."""
    step_dir = os.path.join(root, f"run-step{step}")
    os.makedirs(step_dir)
    state = {
        "strategy": "dflash2-csbp" if model.config.is_dflash2 else "dflash-csbp",
        "draft_state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "csbp_draft_config": json.dumps(model.config.to_dict()),
        "global_step": step,
    }
    torch.save(state, os.path.join(step_dir, "training_state.pt"))
    os.symlink(f"run-step{step}", os.path.join(root, "run-latest"))
    return root


def greedy_reference(target, prompt: torch.Tensor, n: int) -> list[int]:
    """Plain greedy decoding without any cache: the whole sequence every step."""
    ids = prompt.tolist()
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out
