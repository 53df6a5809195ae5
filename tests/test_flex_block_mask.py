"""The chunked BlockMask builder equals torch's create_block_mask on the same rule (CPU, forward)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from specforge_csbp.attention import partial_attention
from specforge_csbp.attention.flex import block_mask_for
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.masks import Visibility


def _visibilities():
    for mode, L, S, P in [("reference", 200, 8, 1), ("csbp", 320, 16, 3), ("cp", 256, 64, 2), ("bp", 192, 8, 2)]:
        for rule in ("causal", "bidirectional"):
            for plan in bdlm_plan(mode, L, S, P):
                yield Visibility(plan.q_tokens, plan.kv_tokens, S, rule)
                yield Visibility(plan.q_tokens, plan.remote_kv_tokens, S, rule) if len(plan.remote_kv_tokens) else None


@pytest.mark.parametrize("budget", [1 << 14, 1 << 27])  # many chunks, one chunk
def test_chunked_block_mask_equals_create_block_mask(budget):
    for vis in filter(None, _visibilities()):
        ours = block_mask_for(vis, torch.device("cpu"), budget=budget)
        vis._cache.clear()
        theirs = create_block_mask(vis.mask_mod("cpu"), None, None, len(vis.q), len(vis.k), device="cpu")
        assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
        assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)


def test_flex_forward_with_our_block_mask_equals_the_dense_seam():
    torch.manual_seed(0)
    plan = bdlm_plan("csbp", 320, 16, 3)[1]
    vis = Visibility(plan.q_tokens, plan.kv_tokens, 16)
    q = torch.randn(1, 4, len(plan.q_rows), 16)
    k, v = torch.randn(2, 1, 2, len(plan.kv_rows), 16)
    out = flex_attention(q, k, v, block_mask=block_mask_for(vis, torch.device("cpu")), enable_gqa=True)
    ref, _ = partial_attention(q, k, v, vis, backend="dense")
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)
