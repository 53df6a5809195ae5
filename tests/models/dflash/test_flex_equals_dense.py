"""The drafter's attention through the FlexAttention backend equals the dense seam (CPU, forward).

The GPU runs drafters through compiled FlexAttention, which has no CPU backward and whose CPU compile
cannot return the LSE; eager flex_attention computes the same block-masked attention on CPU, so this
checks what the GPU path depends on: block masks built from the rule for sliding windows (causal and
bidirectional draft blocks), full layers, and plans padded to a row bucket.
"""

import pytest
import torch

from specforge_csbp.models.dflash import AttentionOptions, drafter_plans, make_dflash_config, plan_attention
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors


@pytest.mark.parametrize("is_causal", [None, False])
@pytest.mark.parametrize("bucket", [1, 64])
def test_drafter_attention_flex_equals_dense(eager_flex, is_causal, bucket):
    cfg = make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=61, num_target_layers=6, target_layer_ids=[1, 4], mask_token_id=60,
        block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=37, is_causal=is_causal,
    )  # fmt: skip
    L = 300
    anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=13), block_size=4)
    (plan,) = drafter_plans("reference", L, anchors, cfg, 1, bucket=bucket)
    dense = plan_attention(plan, options=AttentionOptions(backend="dense"))
    flex = plan_attention(plan, options=AttentionOptions(backend="flex"))
    g = torch.Generator().manual_seed(0)
    for kind, layer in plan.layers.items():
        q = torch.randn(1, 4, layer.shard.q_rows.numel(), 16, generator=g)
        k, v = torch.randn(2, 1, 2, layer.shard.kv_rows.numel(), 16, generator=g)
        with torch.no_grad():
            out_d, lse_d = dense[kind].attend(q, k, v)
            out_f, lse_f = flex[kind].attend(q, k, v)
        seen = lse_d.isfinite()
        assert seen.any()
        assert torch.allclose(out_f, out_d, atol=2e-6, rtol=0), kind
        assert torch.allclose(lse_f[seen], lse_d[seen], atol=2e-6, rtol=0), kind
