"""Bad drafter inputs fail early with one-line errors that name the field and the allowed values."""

import torch

from specforge_csbp.models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    DrafterSample,
    drafter_plans,
    drafter_step,
    make_dflash_config,
)
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors
from tests.support.checks import raises_one_line

BASE = {
    "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 8, "vocab_size": 17, "num_target_layers": 6, "target_layer_ids": [1, 4], "mask_token_id": 16, "block_size": 4,
}  # fmt: skip


def config(**kw):
    return make_dflash_config(**{**BASE, **kw})


def test_target_layer_ids_out_of_range():
    raises_one_line(r"dflash_config.target_layer_ids\[1\] = 9 is out of range for num_target_layers = 6; allowed 0..5",
                    config, target_layer_ids=[1, 9])  # fmt: skip
    raises_one_line(r"dflash_config.target_layer_ids\[0\] = -1", config, target_layer_ids=[-1, 2])
    good = config().to_dict()
    good["dflash_config"]["target_layer_ids"] = [0, 6]  # a hand-edited config.json is checked when loaded
    raises_one_line(r"target_layer_ids\[1\] = 6 is out of range", DFlashDraftModel, DFlashConfig(**good))


def test_feature_width_must_be_layers_times_hidden():
    model = DFlashDraftModel(config()).double()
    L = 20
    sample = DrafterSample(torch.arange(L) % 16, torch.ones(L), torch.zeros(L, 48, dtype=torch.float64))
    raises_one_line(
        r"features: last dim 48 != len\(dflash_config.target_layer_ids\) = 2 x hidden_size = 16 = 32",
        drafter_step, model, [sample], objective=DFlashObjective(num_anchors=2), mode="reference",
        head_weight=torch.zeros(17, 16, dtype=torch.float64), embed_weight=torch.zeros(17, 16, dtype=torch.float64),
    )  # fmt: skip


def test_fewer_valid_anchors_than_requested():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 0, 0.0])  # valid anchors: 1, 2, 5
    raises_one_line(r"num_anchors: requested 5 but sample 0 has only 3 valid anchor positions",
                    sample_anchors, mask, DFlashObjective(num_anchors=5, shortfall="error"), block_size=4)  # fmt: skip
    assert sample_anchors(mask, DFlashObjective(num_anchors=5), block_size=4).tolist() == [1, 2, 5]  # use_all
    raises_one_line(r"loss_mask: sample 0 has no valid anchor", sample_anchors,
                    torch.tensor([1, 0, 1, 0.0]), DFlashObjective(), block_size=4)  # fmt: skip
    raises_one_line(r"anchors: 1 anchors cannot be spread over 2 ranks", drafter_plans,
                    "csbp", 40, torch.tensor([7]), config(), 2)  # fmt: skip


def test_block_size_below_two():
    raises_one_line(r"block_size must be >= 2 \(slot 0 holds the anchor, slots 1.. are drafted\); got 1",
                    config, block_size=1)  # fmt: skip


def test_selector_top_k_above_vocab():
    raises_one_line(r"dflash_config.selector_top_k = 18 must be in 1..vocab_size = 17",
                    config, dflash2=True, conv_group_size=8, selector_rank=4, selector_top_k=18)  # fmt: skip


def test_other_fields_are_named():
    raises_one_line(r"dflash_config.conv_group_size = 5 must divide hidden_size = 16",
                    config, dflash2=True, conv_group_size=5, selector_top_k=3)  # fmt: skip
    raises_one_line(r"sliding_window must be >= block_size = 4", config,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=2)  # fmt: skip
    raises_one_line(r"loss_type must be one of dflash, dpace", DFlashObjective, loss_type="kl")
    raises_one_line(r"sampling must be one of uniform, locality", DFlashObjective, sampling="random")
    raises_one_line(
        r"mode must be one of reference, dp, cp, csbp",
        drafter_plans,
        "bp",
        40,
        torch.tensor([3]),
        config(),
        1,
    )
