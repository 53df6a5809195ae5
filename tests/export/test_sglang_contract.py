"""The export against SGLang's DFLASH / DFLASH2 loader contract: what passes, what SGLang would silently
misload (and the check refuses), reload equivalence, provenance, and the one-line refusals."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from specforge_csbp.export.checkpoint import load_checkpoint
from specforge_csbp.export.sglang_contract import check_config, check_export, expected_params, simulate_load
from specforge_csbp.export.writer import export_drafter, load_exported
from specforge_csbp.models.dflash.configuration import DFlashConfig, make_dflash_config
from specforge_csbp.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
from specforge_csbp.outputs import file_sha256
from specforge_csbp.models.dflash.sharding import reference_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(dflash2: bool, *, conv: bool = True):
    config = make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=5, block_size=4,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, dflash2=dflash2,
        conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(config)
    with torch.no_grad():  # move off the identity / zero initialisation so every tensor matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _outputs(model):
    g = torch.Generator().manual_seed(1)
    S, H, L = model.block_size, model.config.hidden_size, 24
    anchors = torch.tensor([3, 10, 19])
    positions = (anchors[:, None] + torch.arange(S)).reshape(-1)
    with torch.no_grad():
        return model.eval()(
            torch.randn(1, anchors.numel() * S, H, generator=g), positions,
            torch.randn(1, L, 2 * H, generator=g), torch.arange(L),
            reference_attention(model.config, anchors, torch.arange(L)),
        )  # fmt: skip


@pytest.mark.parametrize("dflash2", [True, False])
@pytest.mark.parametrize("to", ["sglang", "hf"])
def test_export_meets_contract_and_reloads_identically(tmp_path, dflash2, to):
    model = _tiny(dflash2)
    model.save_pretrained(tmp_path / "trained")
    out = tmp_path / f"export-{to}"
    result = export_drafter(str(tmp_path / "trained"), str(out), to=to)
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    report = check_export(config, {k: tuple(v.shape) for k, v in weights.items()})
    arch = "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
    assert report.ok and config["architectures"] == [arch] and result.architecture == arch
    assert not report.ignored and len(report.loaded) == len(expected_params(check_config(config)))
    assert ("candidate_selector.successor_codebook" in weights) is dflash2
    assert torch.equal(_outputs(model), _outputs(load_exported(str(out))))
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["to"] == to and provenance["architecture"] == arch
    assert provenance["source"]["sha256"] == file_sha256(str(tmp_path / "trained" / "model.safetensors"))
    assert provenance["files"]["model.safetensors"] == file_sha256(str(out / "model.safetensors"))


def test_export_casts_dtype_and_overwrites_only_its_own_exports(tmp_path):
    _tiny(True).save_pretrained(tmp_path / "trained")
    out = str(tmp_path / "out")
    export_drafter(str(tmp_path / "trained"), out, dtype="bfloat16")
    assert {v.dtype for v in load_file(os.path.join(out, "model.safetensors")).values()} == {torch.bfloat16}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"^OUT: .*/out already exists; pass --overwrite to replace it$"):
        export_drafter(str(tmp_path / "trained"), out)
    export_drafter(str(tmp_path / "trained"), out, overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="is not a specforge-csbp export .* refusing to overwrite it"):
        export_drafter(str(tmp_path / "trained"), str(tmp_path / "mine"), overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_export_refuses_what_is_not_a_csbp_drafter(tmp_path):
    stock = tmp_path / "run-step3"
    stock.mkdir()
    torch.save(
        {"strategy": "dflash", "draft_state_dict": {"fc.weight": torch.zeros(2, 2)}},
        stock / "training_state.pt",
    )
    with pytest.raises(
        ValueError, match=r"CHECKPOINT: .* was written by SpecForge strategy 'dflash', not a CSBP drafter"
    ):
        export_drafter(str(stock), str(tmp_path / "o1"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="CHECKPOINT: .* is not a drafter checkpoint"):
        export_drafter(str(tmp_path / "empty"), str(tmp_path / "o2"))
    model = _tiny(True)
    model.save_pretrained(tmp_path / "eagle")
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (tmp_path / "eagle" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"CHECKPOINT: .* is not a CSBP drafter \(architectures \['LlamaForCausalLMEagle3'\]"
    ):
        load_checkpoint(str(tmp_path / "eagle"))
    with pytest.raises(ValueError, match="CHECKPOINT: .* does not exist"):
        export_drafter(str(tmp_path / "nowhere"), str(tmp_path / "o3"))
    assert not any(os.path.exists(tmp_path / o) for o in ("o1", "o2", "o3"))


def _contract():
    model = _tiny(True)
    config = json.loads(DFlashConfig(**model.config.to_dict()).to_json_string())
    config.update(model_type="qwen3")
    return check_config(config), {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_loader_replay_catches_what_sglang_would_silently_misload():
    fields, shapes = _contract()
    assert simulate_load(fields, shapes).ok
    assert simulate_load(fields, {f"model.{k}": v for k, v in shapes.items()}).ok  # SGLang strips "model."

    renamed = {k.replace("self_attn.o_proj", "self_attn.out_proj"): v for k, v in shapes.items()}
    report = simulate_load(fields, renamed)
    assert report.ignored == ["layers.0.self_attn.out_proj.weight", "layers.1.self_attn.out_proj.weight"]
    assert report.missing == ["layers.0.self_attn.o_proj.weight", "layers.1.self_attn.o_proj.weight"]

    no_k = {k: v for k, v in shapes.items() if k != "layers.1.self_attn.k_proj.weight"}
    assert simulate_load(fields, no_k).partial == [
        "layers.1.self_attn.qkv_proj.weight (got shards ['q', 'v'])"
    ]

    wide = dict(shapes, **{"layers.0.mlp.up_proj.weight": (49, 32)})
    assert "layers.0.mlp.up_proj.weight [49, 32] != shard 1 of layers.0.mlp.gate_up_proj.weight [48, 32]" in (
        simulate_load(fields, wide).shape_errors
    )
    no_selector = {k: v for k, v in shapes.items() if not k.startswith("candidate_selector.")}
    assert simulate_load(fields, no_selector).missing == [
        "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
    ]  # fmt: skip
    with pytest.raises(
        ValueError, match="export does not meet SGLang's DFlash2DraftModel loader contract: .*ignored"
    ):
        check_export({**_config_json(), "model_type": "qwen3"}, renamed)


def _config_json():
    return json.loads(DFlashConfig(**_tiny(True).config.to_dict()).to_json_string())


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: c.update(architectures=["DFlash3DraftModel"]), "architectures must be one of"),
        (lambda c: c.update(model_type="llama"), "model_type must be 'qwen3'"),
        (lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank and selector_top_k must be set together"),
        (lambda c: [c["dflash_config"].pop(k) for k in ("selector_rank", "selector_top_k")],
         "DFlash2DraftModel requires dflash_config.selector_rank"),
        (lambda c: c["dflash_config"].update(conv_group_size=0), "conv_kernel_size and conv_group_size must be set together"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 6]), r"target_layer_ids \[6\] out of range for num_target_layers=6"),
        (lambda c: c["dflash_config"].update(mask_token_id=None), "dflash_config.mask_token_id must be an integer >= 0"),
        (lambda c: c.update(sliding_window=None), "sliding_window is required"),
    ],
)  # fmt: skip
def test_config_checks_name_the_field(change, message):
    config = {**_config_json(), "model_type": "qwen3"}
    change(config)
    with pytest.raises(ValueError, match=message):
        check_config(config)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "drafter_configs", "*.json"))))
def test_shipped_drafter_configs_meet_the_contract_at_full_size(path):
    with open(path) as f:
        raw = json.load(f)
    config = DFlashConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    config.validate_dflash()
    with torch.device("meta"):  # real shapes, no memory
        model = (DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel)(config)
    report = check_export(raw, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    assert report.ok and raw["dflash_config"]["target_layer_ids"] == config.target_layer_ids
    assert max(config.target_layer_ids) <= config.target_num_layers - 2  # capture points exist in the target
