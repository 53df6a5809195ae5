"""Token sets of tiny DFlash drafter plans, shared by the mask tests (rule, block masks)."""

import torch

from specforge_csbp.models.dflash import drafter_plans, make_dflash_config
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors


def drafter_shards(seq_len, num_anchors, block_size, window, layouts, bucket):
    """(query tokens, key tokens, window, noisy_causal) of every rank and layer kind - local and gathered
    keys - of drafter plans with a sliding and a full layer, for causal and bidirectional draft blocks."""
    for causal in (None, False):
        cfg = make_dflash_config(
            hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, vocab_size=32, num_target_layers=3, target_layer_ids=[1], mask_token_id=31,
            block_size=block_size, layer_types=["sliding_attention", "full_attention"], sliding_window=window,
            is_causal=causal,
        )  # fmt: skip
        anchors = sample_anchors(torch.ones(seq_len), DFlashObjective(num_anchors=num_anchors), block_size=block_size)
        for mode, world in layouts:
            for plan in drafter_plans(mode, seq_len, anchors, cfg, world, bucket=bucket):
                for lp in plan.layers.values():
                    for keys in (lp.shard.kv_tokens, lp.shard.remote_kv_tokens):
                        yield lp.shard.q_tokens, keys, lp.window, lp.noisy_causal
