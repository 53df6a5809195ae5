"""Serving the export: `--to vllm` against vLLM's loader as read from its wheel's source, the version floors
and serve commands, the dtype default (the target's), and drafter causality the servers run as trained."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specforge_csbp.cli.main import main
from specforge_csbp.export.vllm_contract import VLLM_PREFIX, VLLM_STACKED, check_vllm_export, vllm_name
from specforge_csbp.export.writer import export_drafter, serve_commands
from specforge_csbp.models.dflash.configuration import DFlashConfig, make_dflash_config
from tests.export.test_sglang_contract import _tiny
from tests.support.checks import raises_one_line
from tests.support.vllm_source import VLLMSource

VLLM = "0.33.0"


@pytest.fixture(scope="module")
def vllm():
    return VLLMSource(VLLM)


def _export(tmp_path, model, to, name="out", **kw):
    model.save_pretrained(tmp_path / f"{name}-trained")
    out = tmp_path / name
    result = export_drafter(str(tmp_path / f"{name}-trained"), str(out), to=to, **kw)
    return out, result


def vllm_problems(source: VLLMSource, out) -> list[str]:
    """What vLLM `source` would do with the export: names placed by its own prefix + stacked table, against
    the parameters its classes build."""
    config = json.loads((out / "config.json").read_text())
    top = (
        "DFlash2Qwen3ForCausalLM"
        if config["architectures"] == ["DFlash2DraftModel"]
        else "DFlashQwen3ForCausalLM"
    )
    want = source.parameters(top, config["num_hidden_layers"], bias=config.get("attention_bias", False))
    prefix, stacked = source.prefix(), source.stacked()
    placed: dict[str, set] = {}
    problems = []
    for name in load_file(str(out / "model.safetensors")):
        full, shard = (name if "lm_head" in name else prefix + name), None
        for old, (new, sid) in stacked.items():
            if old + "." in full:
                full, shard = full.replace(old + ".", new + "."), sid
                break
        if full not in want:
            problems.append(f"no parameter {full} (from {name})")
        placed.setdefault(full, set()).add(shard)
    problems += [f"missing {p}" for p in sorted(want - set(placed))]
    for p, shards in placed.items():
        need = {s for (new, s) in stacked.values() if f"{new}." in p} or {None}
        if shards != need:
            problems.append(f"partial {p} ({sorted(map(str, shards))})")
    return problems


@pytest.mark.parametrize("dflash2", [True, False])
def test_vllm_export_places_every_tensor_in_vllms_own_parameters(tmp_path, vllm, dflash2):
    out, result = _export(tmp_path, _tiny(dflash2), "vllm")
    assert vllm_problems(vllm, out) == []
    assert result.contract == f"{30 if dflash2 else 19} parameters loaded"
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["to"] == "vllm" and provenance["vllm_contract"] == result.contract
    # the project's replay of vLLM (export/vllm_contract.py) holds the tables vLLM's source holds
    assert VLLM_STACKED == vllm.stacked() and VLLM_PREFIX == vllm.prefix()


def test_a_broken_vllm_export_fails_against_vllms_source(tmp_path, vllm):
    from safetensors.torch import save_file

    out, _ = _export(tmp_path, _tiny(True), "vllm")
    weights = load_file(str(out / "model.safetensors"))
    save_file(
        {f"model.{k}": v for k, v in weights.items()}, str(out / "model.safetensors")
    )  # vLLM prefixes itself
    assert "no parameter model.model.fc.weight (from model.fc.weight)" in vllm_problems(vllm, out)
    save_file(
        {k.replace("k_proj", "key_proj"): v for k, v in weights.items()}, str(out / "model.safetensors")
    )
    found = vllm_problems(vllm, out)
    assert "partial model.layers.0.self_attn.qkv_proj.weight (['q', 'v'])" in found, found
    fields = json.loads((out / "config.json").read_text())
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    with pytest.raises(
        ValueError, match=r"names vLLM would misplace: \['model.candidate_selector.hidden_projection.weight'"
    ):
        check_vllm_export(fields, {f"model.{k}": v for k, v in shapes.items()})
    with pytest.raises(ValueError, match="vLLM reads dflash_config.target_layer_ids"):
        bad = json.loads(json.dumps(fields))
        bad["target_layer_ids"] = bad["dflash_config"].pop("target_layer_ids")
        check_vllm_export(bad, shapes)
    assert vllm_name("layers.3.mlp.up_proj.weight") == ("model.layers.3.mlp.gate_up_proj.weight", 1)


def test_floors_and_serve_commands(tmp_path, capsys):
    model = _tiny(True)
    model.save_pretrained(tmp_path / "trained")
    out = tmp_path / "out"
    assert main(["export", "--to", "sglang", str(tmp_path / "trained"), str(out)]) == 0
    printed = capsys.readouterr().out
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["min_versions"] == {"sglang": "0.5.19", "vllm": "0.28.0"}
    assert "loader contracts met: SGLang, vLLM (30 parameters loaded)" in printed
    assert provenance["sglang_contract"] == provenance["vllm_contract"] == "30 parameters loaded"
    commands = serve_commands(str(out.resolve()), provenance["config"])
    assert "serve with SGLang (sglang>=0.5.19):" in printed and "serve with vLLM (vllm>=0.28.0):" in printed
    assert commands["sglang"].split("\n")[1] in printed and commands["vllm"].split("\n")[1] in printed
    assert (
        "--speculative-num-draft-tokens 4" in commands["sglang"]
        and "--speculative-algorithm DFLASH" in printed
    )
    # vLLM counts drafted tokens without the bonus token; the tiny drafter mixes sliding and full layers
    assert '"num_speculative_tokens": 3' in commands["vllm"]
    assert commands["vllm"].split("\n")[1].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve <TARGET_MODEL>")
    _tiny(False).save_pretrained(tmp_path / "v1")
    result = export_drafter(str(tmp_path / "v1"), str(tmp_path / "v1-out"))
    assert (
        json.loads((tmp_path / "v1-out" / "provenance.json").read_text())["min_versions"]["sglang"]
        == "0.5.14"
    )
    assert serve_commands("D", {**result.config, "is_causal": False})["sglang"].startswith("# sglang>=0.5.18")
    hf = export_drafter(str(tmp_path / "v1"), str(tmp_path / "hf-out"), to="hf")
    assert (
        json.loads((tmp_path / "hf-out" / "provenance.json").read_text())["min_versions"] is None
        and hf.contract is None
    )


def _target(tmp_path, **fields):
    path = tmp_path / "target"
    path.mkdir(exist_ok=True)
    # the target _tiny's drafter reads (export checks the pair: hidden size, vocabulary, depth)
    target = {"model_type": "qwen3", "hidden_size": 32, "vocab_size": 64, "num_hidden_layers": 6}
    (path / "config.json").write_text(json.dumps({**target, **fields}))
    return str(path)


@pytest.mark.parametrize(
    "fields,dtype,expected,source",
    [
        ({"torch_dtype": "bfloat16"}, None, torch.bfloat16, "target"),
        ({"dtype": "float16"}, None, torch.float16, "target"),  # transformers 5 writes `dtype`
        ({"text_config": {"dtype": "bfloat16"}}, None, torch.bfloat16, "target"),  # a multimodal target
        ({"torch_dtype": "bfloat16"}, "float32", torch.float32, "--dtype"),  # --dtype wins
        ({}, None, torch.float32, "checkpoint"),  # no dtype declared: as trained
    ],
)  # fmt: skip
def test_export_takes_the_targets_dtype_unless_told(tmp_path, fields, dtype, expected, source):
    out, _result = _export(tmp_path, _tiny(True), "sglang", target=_target(tmp_path, **fields), dtype=dtype)
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {expected}
    name = str(expected).replace("torch.", "")
    assert json.loads((out / "config.json").read_text())["dtype"] == name  # what SGLang's --dtype auto reads
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["dtype"] == name and provenance["dtype_source"].startswith(source)


def test_export_without_target_keeps_the_trained_dtype_and_refuses_a_bad_target_dtype(tmp_path):
    _out, result = _export(tmp_path, _tiny(True), "sglang")
    assert result.dtype == "float32" and result.dtype_source.startswith("checkpoint")
    with pytest.raises(
        ValueError, match=r"--target: .*config.json declares dtype 'int8'; expected one of float32"
    ):
        _export(tmp_path, _tiny(True), "sglang", name="o2", target=_target(tmp_path, torch_dtype="int8"))


# -- causality: train what SGLang / vLLM run ------------------------------------------------------------
_BASE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "vocab_size": 64, "num_target_layers": 6, "target_layer_ids": [1, 3], "mask_token_id": 5, "block_size": 4,
             "sliding_window": 8}  # fmt: skip


def test_causal_true_with_a_full_attention_layer_is_refused():
    raises_one_line(r"^is_causal = true makes SGLang and vLLM run full_attention layers causally, which the trainer "
                    r"keeps bidirectional; allowed: false, unset, or true only when every layer is sliding_attention$",
                    make_dflash_config, **_BASE, layer_types=["sliding_attention", "full_attention"],
                    is_causal=True)  # fmt: skip
    config = make_dflash_config(**_BASE, layer_types=["sliding_attention"] * 2, is_causal=True)
    assert config.sliding_layers_causal
    assert not make_dflash_config(**_BASE, layer_types=["sliding_attention", "full_attention"],
                                  is_causal=False).sliding_layers_causal  # fmt: skip


def test_dflash_config_causal_is_refused():
    data = make_dflash_config(**_BASE, layer_types=["sliding_attention", "full_attention"]).to_dict()
    for value in (False, True):
        data["dflash_config"]["causal"] = value
        raises_one_line(rf"^dflash_config.causal = {value} is not read by SGLang \(vLLM applies it to every "
                        r"layer\); remove it and set the top-level is_causal: false",
                        DFlashConfig(**data).validate_dflash)  # fmt: skip
    data["dflash_config"].pop("causal")
    data["is_causal"] = "yes"
    raises_one_line(r"^is_causal must be true, false or unset; got 'yes'$", DFlashConfig(**data).validate_dflash)
