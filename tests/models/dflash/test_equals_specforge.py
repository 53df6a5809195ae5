"""Our DFlash drafter and objective against SpecForge 0.2.0's own (an independent implementation).

Same weights (SpecForge's DFlashDraftModel loads our state dict strictly), same anchors (SpecForge's sampler
is replaced by ours), sdpa masks from SpecForge's own builder, full and sliding-window layers: the loss and
every parameter gradient agree. SpecForge's RMSNorm computes in float32, so agreement is ~1e-7, not 1e-12.
"""

import pytest
import torch
from specforge.algorithms.common.dflash_family_model import (
    OnlineDFlashModel,  # installed by scripts/setup_env.sh
)
from specforge.modeling.draft.dflash import DFlashDraftModel as SpecForgeDraft
from transformers import Qwen3Config

from specforge_csbp.models.dflash import DFlashDraftModel, DrafterSample, drafter_step, make_dflash_config
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors

TOL = 1e-5


@pytest.mark.parametrize("loss_type", ["dflash", "dpace"])
def test_loss_and_gradients_match_specforge(loss_type):
    cfg = make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=61, num_target_layers=6, target_layer_ids=[1, 4], mask_token_id=60, block_size=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=7,
    )  # fmt: skip
    ours = DFlashDraftModel(cfg).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if p.dim() == 1 else 0.0)
            )
    sf_config = Qwen3Config(
        **{k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "transformers_version")}
    )
    sf_config._attn_implementation = "sdpa"
    theirs = SpecForgeDraft(sf_config).double()
    theirs.load_state_dict(ours.state_dict(), strict=True)  # identical parameter names and shapes

    L = 40
    ids = torch.randint(0, 60, (L,), generator=g)
    mask = torch.ones(L, dtype=torch.float64)
    mask[:2], mask[30] = 0, 0
    feats = torch.randn(L, 64, generator=g, dtype=torch.float64)
    head = torch.randn(61, 32, generator=g, dtype=torch.float64) * 0.5
    embed = torch.randn(61, 32, generator=g, dtype=torch.float64)
    obj = DFlashObjective(num_anchors=6, gamma=4.0, loss_type=loss_type)
    anchors = sample_anchors(mask, obj, block_size=4)

    lm_head = torch.nn.Linear(32, 61, bias=False).double()
    lm_head.weight.data.copy_(head)
    embedding = torch.nn.Embedding(61, 32).double()
    embedding.weight.data.copy_(embed)
    online = OnlineDFlashModel(
        theirs, lm_head, embedding, mask_token_id=60, block_size=4, attention_backend="sdpa", num_anchors=6,
        loss_decay_gamma=4.0, loss_type=loss_type,
    )  # fmt: skip
    online._sample_anchor_positions = lambda *_: (
        anchors[None],
        torch.ones(1, anchors.numel(), dtype=torch.bool),
    )
    their_loss, _, _ = online(ids[None], feats[None], mask[None])
    their_loss.backward()

    res = drafter_step(ours, [DrafterSample(ids, mask, feats)], objective=obj, mode="reference",
                       head_weight=head, embed_weight=embed)  # fmt: skip
    assert res.loss == pytest.approx(float(their_loss), rel=TOL)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        ref = theirs_params[name].grad
        assert ref.abs().max() > 0, name
        assert float((p.grad - ref).abs().max() / ref.abs().max()) < TOL, name
