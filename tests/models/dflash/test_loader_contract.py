"""The serving contract: what SGLang's DFLASH / DFLASH2 loaders (and vLLM's DFlash2) read from a checkpoint.

Recorded from sglang `python/sglang/srt/models/dflash.py` + `speculative/dflash_utils.py` and the DFlash2
loaders built on the same checkpoint format (SpecForge `configs/qwen3.6-27b-dflash2.json`, Turbo-dLLM
`dflash2.py`): the loader fuses q/k/v -> qkv_proj and gate/up -> gate_up_proj by name, checks fc.weight's
shape against len(target_layer_ids) x hidden_size, and silently ignores any other name - so names and shapes
are pinned here, not assumed. The drafter has no embedding and no LM head (the target's are used).
"""

import json

import torch

from specforge_csbp.models.dflash import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, make_dflash_config

H, I, HEADS, KV, D, V, S = 32, 48, 4, 2, 8, 61, 4
LAYER_IDS, TAPS, GROUP, RANK, TOPK = [1, 3, 5], 2, 8, 6, 5


def expected_state(dflash2: bool, layers: int) -> dict[str, tuple[int, ...]]:
    names = {"fc.weight": (H, len(LAYER_IDS) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(layers):
        p = f"layers.{i}."
        names.update({
            p + "self_attn.q_proj.weight": (HEADS * D, H), p + "self_attn.k_proj.weight": (KV * D, H),
            p + "self_attn.v_proj.weight": (KV * D, H), p + "self_attn.o_proj.weight": (H, HEADS * D),
            p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })  # fmt: skip
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                names[p + conv + ".base_kernel"] = (2, TAPS, H)
                names[p + conv + ".kernel_projection.weight"] = (2 * TAPS * (H // GROUP), H)
    if dflash2:
        names.update({
            "candidate_selector.predecessor_codebook": (V, RANK), "candidate_selector.successor_codebook": (V, RANK),
            "candidate_selector.hidden_projection.weight": (RANK, H),
        })  # fmt: skip
    return names


def build(dflash2: bool):
    return make_dflash_config(
        hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV,
        head_dim=D, vocab_size=V, num_target_layers=8, target_layer_ids=LAYER_IDS, mask_token_id=60, block_size=S,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16, dflash2=dflash2,
        conv_kernel_size=TAPS, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOPK,
    )  # fmt: skip


def test_parameter_names_and_shapes_are_the_loaders():
    for dflash2, cls in ((False, DFlashDraftModel), (True, DFlash2DraftModel)):
        state = cls(build(dflash2)).state_dict()
        assert {k: tuple(v.shape) for k, v in state.items()} == expected_state(dflash2, 2)
        assert not any("embed_tokens" in k or "lm_head" in k or "rotary" in k for k in state)


def test_saved_config_carries_every_field_the_loaders_read(tmp_path):
    for dflash2, cls in ((False, DFlashDraftModel), (True, DFlash2DraftModel)):
        model = cls(build(dflash2))
        model.save_pretrained(tmp_path / cls.__name__)
        cfg = json.loads((tmp_path / cls.__name__ / "config.json").read_text())
        assert cfg["model_type"] == "qwen3" and cfg["architectures"] == [cls.__name__]
        assert cfg["block_size"] == S and cfg["num_target_layers"] == 8
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 16
        dc = cfg["dflash_config"]
        assert dc["target_layer_ids"] == LAYER_IDS and dc["mask_token_id"] == 60 and dc["block_size"] == S
        d2 = {
            "conv_kernel_size": TAPS,
            "conv_group_size": GROUP,
            "selector_rank": RANK,
            "selector_top_k": TOPK,
        }
        assert {k: dc.get(k) for k in d2} == (d2 if dflash2 else dict.fromkeys(d2))
        loaded = cls.from_pretrained(tmp_path / cls.__name__)
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k


def test_published_config_layouts_load():
    # SpecForge's qwen3-8b-dflash.json layout: block_size top-level, no mask id under dflash_config in old files
    specforge_dflash = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_target_layers": 36,
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": D, "vocab_size": V, "rope_theta": 1000000,
        "layer_types": ["full_attention"] * 2, "dflash_config": {"mask_token_id": 7},
    }  # fmt: skip
    cfg = DFlashConfig(**specforge_dflash)
    cfg.validate_dflash()
    assert cfg.draft_block_size == 16 and cfg.target_layer_ids == [1, 33]  # SGLang/SpecForge default layers
    # SpecForge's qwen3.6-27b-dflash2.json layout: block_size only in dflash_config, is_causal false
    dflash2 = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False, "num_target_layers": 64,
        "dflash_config": {"block_size": 8, "conv_group_size": GROUP, "conv_kernel_size": TAPS, "mask_token_id": 60,
                          "selector_rank": RANK, "selector_top_k": TOPK, "target_layer_ids": [5, 19, 33]},
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "head_dim": D, "vocab_size": V, "use_sliding_window": True, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 2, "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    }  # fmt: skip
    cfg = DFlashConfig(**dflash2)
    model = DFlash2DraftModel(cfg)
    assert model.block_size == 8 and cfg.sliding_layers_causal is False and model.fc.in_features == 3 * H
