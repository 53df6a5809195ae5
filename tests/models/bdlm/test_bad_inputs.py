"""Bad inputs to BDLM training fail with one line naming the field (or the model) and what is allowed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from specforge_csbp.cli.main import main
from specforge_csbp.models.bdlm import BDLMModel
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS
from specforge_csbp.objectives.convert import ConvertObjective
from specforge_csbp.objectives.sft import SFTObjective

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _cli_error(capsys, *args: str) -> str:
    """Run `train-bdlm` with the tiny SFT recipe; it must fail before starting any process, with one line."""
    rc = main(["train-bdlm", "-c", str(EXAMPLES / "bdlm_sft_tiny.yaml"), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "override, expected",
    [
        ("objective.mask_token_id=128", "objective.mask_token_id must be in [0, 128)"),
        ("objective.mask_token_id=-1", "objective.mask_token_id must be in [0, 128)"),
        ("data.max_length=60", "data.max_length (60) must be a multiple of model.block_size (8)"),
        ("parallel.world_size=3", "parallel: dp_degree x cp_degree = 1 x 2 must equal the world size 3"),
        ("parallel.dp_degree=2", "parallel: dp_degree x cp_degree = 2 x 2 must equal the world size 2"),
        ("parallel.mode=ring", "parallel.mode: Input should be 'csbp', 'cp', 'bp' or 'reference'"),
        ("train.lrr=1", "train.lrr: Extra inputs are not permitted"),
        ("train.lr=abc", "train.lr: Input should be a valid number"),
        ("model.config.model_type=bloom", "model: BloomForCausalLM does not route attention"),
        ("data.max_length=8", "1 blocks < world_size = 2"),
        ("objective.kind=dpo", "objective.kind: Input should be 'sft' or 'convert'"),
        ("train.lr", "override 'train.lr' must look like section.field=value"),
        ("trainlr=1", "trainlr: Extra inputs are not permitted"),
        ("objective.router_aux_tokens=all", "objective.router_aux_tokens: Input should be 'both', 'clean' or"),
    ],
)
def test_cli_one_line_errors(capsys, override, expected):
    assert expected in _cli_error(capsys, override)


def test_cli_missing_config(capsys):
    rc = main(["train-bdlm", "-c", "/nonexistent/recipe.yaml"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "config: /nonexistent/recipe.yaml does not exist" in err and len(err.splitlines()) == 1


def test_objective_errors():
    with pytest.raises(ValueError, match=r"objective.mask_token_id must be in \[0, 64\)"):
        SFTObjective(4, 64, 64)
    with pytest.raises(ValueError, match=r"objective.mask_token_id must be in \[0, 64\)"):
        ConvertObjective(4, -1, 64)
    with pytest.raises(ValueError, match="objective.weighting must be one of inv_t, unit"):
        SFTObjective(4, 63, 64, weighting="sqrt")
    with pytest.raises(ValueError, match="objective.noise must be one of stratified, antithetic, uniform"):
        ConvertObjective(4, 63, 64, noise="sobol")
    obj = SFTObjective(4, 63, 64)
    with pytest.raises(
        ValueError, match="data.max_length: sequence length 10 is not a multiple of model.block_size=4"
    ):
        obj.build(torch.zeros(1, 10, dtype=torch.long), None, [0])
    with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, 64\)"):
        obj.build(torch.full((1, 8), 64), None, [0])


def _tiny(name="qwen3", **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS[name], **overrides)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def test_unroutable_models_are_named():
    from transformers import BloomConfig, BloomForCausalLM

    with pytest.raises(
        ValueError, match="model: BloomForCausalLM does not route attention through transformers"
    ):
        BDLMModel(
            BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)), block_size=4
        )
    with pytest.raises(
        ValueError, match=r"model: Qwen3ForCausalLM config.layer_types has \['linear_attention'\]: a recurrent state"
    ):
        BDLMModel(_tiny(layer_types=["linear_attention", "full_attention"]), block_size=4)
    with pytest.raises(ValueError, match="config.use_bidirectional_attention=True"):
        BDLMModel(_tiny("gemma3", use_bidirectional_attention=True), block_size=4)
    BDLMModel(_tiny(use_sliding_window=True, sliding_window=8, max_window_layers=0), block_size=4)  # routable
    with pytest.raises(ValueError, match="model.block_size must be >= 1"):
        BDLMModel(_tiny(), block_size=0)
    with pytest.raises(ValueError, match="model.clean_within_block must be one of causal, bidirectional"):
        BDLMModel(_tiny(), block_size=4, clean_within_block="full")


def test_runtime_route_checks():
    """A layer that bypasses the interface, or a sliding window shorter than a block, is caught."""
    model = BDLMModel(_tiny(), block_size=4)
    attn = model.attention("reference", 16)
    ids = torch.zeros(1, 32, dtype=torch.long)
    model(ids, attn)  # routes both layers
    layer = model.lm.model.layers[1].self_attn
    layer.config = copy.copy(layer.config)
    layer.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="model: Qwen3ForCausalLM routed 1 of 2 attention layers"):
        model(ids, attn)
    mistral = BDLMModel(_tiny("llama", model_type="mistral", sliding_window=8, attention_bias=False,
                              mlp_bias=False), block_size=4)  # fmt: skip
    mistral(ids, mistral.attention("reference", 16))  # every layer windowed (8 < 16): routed
    assert mistral.layer_windows == (8, 8)
    narrow = BDLMModel(_tiny("llama", model_type="mistral", sliding_window=3, attention_bias=False,
                             mlp_bias=False), block_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="has sliding_window=3 < model.block_size=4; a corrupted block must fit"):
        narrow(ids, narrow.attention("reference", 16))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, 32\]"):
        model(torch.zeros(1, 30, dtype=torch.long), attn)
