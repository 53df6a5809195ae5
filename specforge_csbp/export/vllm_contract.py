"""What vLLM's DFlash / DFlash2 drafter loaders read, and the check that replays it on an export.

Source: vllm `model_executor/models/qwen3_dflash.py` (DFlashQwen3ForCausalLM, DFlashQwen3Model) and
`qwen3_dflash2.py` (DFlash2Qwen3ForCausalLM), read for this project; tests/export/test_vllm_and_serving.py reads the
tables below out of the wheel's source, so they cannot drift from it unnoticed.

    checkpoint name                      vLLM parameter (after its own prefixing and fusing)
    layers.{i}.self_attn.{q,k,v}_proj.*  model.layers.{i}.self_attn.qkv_proj.*   (shard q | k | v)
    layers.{i}.mlp.{gate,up}_proj.*      model.layers.{i}.mlp.gate_up_proj.*     (shard 0 | 1)
    anything else X (but lm_head.*)      model.X
    so an export must NOT carry a `model.` prefix (it would become model.model.X and fail to load)

config.json, beyond SGLang's fields
    dflash_config.target_layer_ids   read there (vLLM adds 1 itself: feature k = hidden_states[id + 1])
    dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}   DFlash2 only, required
    sliding_window                   for sliding layers (or dflash_config.swa_window_size)
    causality                        top-level is_causal, else dflash_config.causal, else sliding = causal,
                                     full = bidirectional (the trainer's rule when neither is set)
    layer_types mixing sliding and full layers needs the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)

DFlash2's in-block convolution is built for 1 + num_speculative_tokens rows: serve with
num_speculative_tokens = block_size - 1. vLLM's DFlash (v1) model has no convolution.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .sglang_contract import check_config, expected_params

__all__ = ["VLLM_PREFIX", "VLLM_STACKED", "check_vllm_export", "vllm_name"]

VLLM_PREFIX = "model."
# DFlashQwen3Model.hf_to_vllm_mapper.orig_to_new_stacked
VLLM_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
                ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}  # fmt: skip
_SHARED = ("lm_head", "embed_tokens", "d2t", "t2d", "mask_hidden")  # the target's, or not DFlash's


def vllm_name(name: str) -> tuple[str, object]:
    """(vLLM parameter, shard or None) a checkpoint tensor lands in."""
    full = name if name.startswith("lm_head") else VLLM_PREFIX + name
    for old, (new, shard) in VLLM_STACKED.items():
        if old + "." in full:
            return full.replace(old + ".", new + "."), shard
    return full, None


def check_vllm_export(config: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]]) -> str:
    """Config + weights against vLLM's loader; one-line ValueError naming what vLLM would refuse or misload."""
    fields = check_config(config)
    dflash = config.get("dflash_config") or {}
    if "target_layer_ids" not in dflash:
        raise ValueError("config.json: vLLM reads dflash_config.target_layer_ids; it is missing")
    if "mask_token_id" not in dflash:
        raise ValueError("config.json: vLLM reads dflash_config.mask_token_id; it is missing")
    if fields["architecture"] == "DFlashDraftModel" and fields["conv_taps"]:
        raise ValueError(
            "config.json: vLLM's DFlashDraftModel has no convolution; dflash_config.conv_kernel_size must be 0"
        )
    bad = sorted(n for n in tensors if n.startswith(VLLM_PREFIX) or n.split(".")[0] in _SHARED)
    if bad:
        raise ValueError(f"export does not meet vLLM's loader contract: names vLLM would misplace: {bad[:4]}")
    want = {VLLM_PREFIX + k: v for k, v in expected_params(fields).items()}
    got: dict[str, set] = {}
    for name in tensors:
        param, shard = vllm_name(name)
        if param not in want:
            raise ValueError(
                f"export does not meet vLLM's loader contract: {name} -> {param} is no parameter"
            )
        got.setdefault(param, set()).add(shard)
    missing = sorted(set(want) - set(got))
    partial = sorted(
        p for p, s in got.items() if None not in s and s != ({"q", "k", "v"} if "qkv" in p else {0, 1})
    )
    if missing or partial:
        raise ValueError(
            f"export does not meet vLLM's loader contract: missing {missing[:4]}, partial {partial[:4]}"
        )
    return f"{len(got)} parameters loaded"
