"""Bad inputs to `specforge train --csbp` fail before any worker starts, in one line naming the flag/field;
good ones resolve to the documented layout and through SpecForge's own registration contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from specforge_csbp.plugin.groups import rank_sets
from specforge_csbp.plugin.launch import preflight
from specforge_csbp.plugin.options import CSBPOptions, compiles_drafter, prepare_run
from specforge_csbp.plugin.registry import objective_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRAFTER = os.path.join(ROOT, "examples", "quickstart_drafter.json")


def _write(tmp_path, training=None, nproc=4, store="store", csbp=None, **top):
    (tmp_path / "target").mkdir(exist_ok=True)  # a local target path must exist (preflight)
    raw = {
        "model": {"target_model_path": str(tmp_path / "target"), "draft_model_config": DRAFTER, "torch_dtype": "float32"},
        "data": {"hidden_states_path": str(tmp_path / store)},
        "training": {"strategy": "dflash2", "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", **(training or {})},
        "deployment": {"trainer": {"nproc_per_node": nproc}},
        **top,
    }  # fmt: skip
    if csbp is not None:
        raw["csbp"] = csbp
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize(
    "training,kwargs,overrides,message",
    [
        ({"strategy": "eagle3"}, {"csbp": True}, [],
         "--csbp: training.strategy='eagle3' is not a DFlash-family algorithm"),
        ({"strategy": "domino"}, {"csbp": True}, [],
         "--csbp: training.strategy='domino' is a DFlash-family algorithm that CSBP does not implement"),
        ({}, {"csbp": True, "cp_size": 3}, [],
         "--cp-size 3 does not divide the world size 4 (deployment.trainer.nnodes=1 x deployment.trainer.nproc_per_node=4)"),
        ({}, {"csbp": True, "cp_size": 2, "dp_replicas": 3}, [], "--dp-replicas 3 does not divide the world size 4"),
        ({}, {"csbp": True, "cp_size": 4, "dp_replicas": 2}, [], "--dp-replicas 2 x --cp-size 4 = 8 != the world size 4"),
        ({}, {"cp_size": 2}, [], "--cp-size: training.strategy='dflash2' is not a CSBP strategy; add --csbp"),
        ({}, {"csbp": True}, ["csbp.cp_sise=2"], "override 'csbp.cp_sise': unknown field"),
        ({}, {"csbp": True}, ["csbp.mode=ring"], "csbp.mode: Input should be 'csbp' or 'cp'"),
        ({}, {"csbp": True}, ["csbp.attention_schedule=fused", "csbp.regather=true"],
         "csbp.regather: Value error, needs csbp.attention_schedule: overlap"),
        ({}, {"csbp": True}, ["csbp.keep_logits_gib=-1"], "csbp.keep_logits_gib: Input should be greater than or equal to 0"),
        ({}, {"csbp": True}, ["csbp.compile=maybe"], "csbp.compile: Value error, must be one of true, false, auto; got 'maybe'"),
        ({}, {"csbp": True}, ["csbp.plateau_steps=-1"], "csbp.plateau_steps: Input should be greater than or equal to 0"),
        ({}, {"csbp": True}, ["csbp.plateau_steps=many"], "csbp.plateau_steps: Input should be a valid integer"),
        ({}, {"csbp": True}, ["csbp.compile=fast"], "csbp.compile: Value error, must be one of true, false, auto; got 'fast'"),
        ({}, {"csbp": True}, ["csbp.compile=2"], "csbp.compile: Value error, must be one of true, false, auto; got 2"),
        ({}, {"csbp": True}, ["csbp.attention_schedule=ring"], "csbp.attention_schedule: Input should be 'fused' or 'overlap'"),
        ({"fsdp_sharding": "FULL_SHARD"}, {"csbp": True}, [], "training.fsdp_sharding='FULL_SHARD'"),
        ({"strategyy": "dflash"}, {"csbp": True}, [], "training.strategyy: Extra inputs are not permitted"),
        ({}, {"csbp": True}, ["data.eval_hidden_states_path=ev", "training.eval_interval=5"],
         "data.eval_hidden_states_path=ev is not a feature store (no manifest.json); fill one with "
         "`specforge-csbp capture` --eval-fraction F (it writes OUT-eval)"),
    ],
)  # fmt: skip
def test_bad_inputs_are_one_line_errors_naming_the_flag_or_field(
    tmp_path, training, kwargs, overrides, message
):
    path = _write(tmp_path, training)
    with pytest.raises(ValueError) as err:
        prepare_run(path, overrides, **kwargs)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_flags_fields_and_overrides_resolve_to_the_same_layout(tmp_path):
    by_flag = prepare_run(_write(tmp_path), [], csbp=True, cp_size=2)
    by_field = prepare_run(_write(tmp_path, {"strategy": "dflash2-csbp"}, csbp={"cp_size": 2}), [])
    by_override = prepare_run(_write(tmp_path), ["csbp.dp_replicas=2"], csbp=True)
    for run in (by_flag, by_field, by_override):
        assert (run.strategy, run.world_size, run.cp_size, run.dp_replicas) == ("dflash2-csbp", 4, 2, 2)
        assert "csbp.cp_size=2" in run.forward_overrides
    assert "training.strategy=dflash2-csbp" in by_flag.forward_overrides
    default = prepare_run(_write(tmp_path, {"strategy": "dflash"}), [], csbp=True)
    assert (default.strategy, default.cp_size, default.dp_replicas) == ("dflash-csbp", 4, 1)
    plain = prepare_run(_write(tmp_path), ["csbp.anchor_sampling=locality"])
    assert (plain.is_csbp, plain.cp_size, plain.dp_replicas, plain.options.anchor_sampling) == (
        False,
        1,
        4,
        "locality",
    )
    memory = prepare_run(_write(tmp_path), ["csbp.regather=true"], csbp=True)
    assert (memory.options.regather, memory.options.attention_schedule) == (True, None)  # overlap, implied
    assert prepare_run(_write(tmp_path), [], csbp=True).options.regather is False
    assert prepare_run(_write(tmp_path), [], csbp=True).options.prefetch_features is True
    assert prepare_run(_write(tmp_path), ["csbp.prefetch_features=false"], csbp=True).options.prefetch_features is False
    assert prepare_run(_write(tmp_path), [], csbp=True).options.store_verify == "lazy"
    assert prepare_run(_write(tmp_path), ["csbp.store_verify=trust"], csbp=True).options.store_verify == "trust"
    with pytest.raises(ValueError, match="store_verify"):
        prepare_run(_write(tmp_path), ["csbp.store_verify=full"], csbp=True)
    assert prepare_run(_write(tmp_path), [], csbp=True).options.gather_ahead is True
    assert prepare_run(_write(tmp_path), ["csbp.gather_ahead=false"], csbp=True).options.gather_ahead is False
    assert prepare_run(_write(tmp_path), [], csbp=True).options.compile == "auto"
    for given, value in (("false", False), ("True", True), ("auto", "auto")):
        assert prepare_run(_write(tmp_path), [f"csbp.compile={given}"], csbp=True).options.compile == value
    # auto: compiled on GPUs, eager on the CPU (the float64 tests); true / false whatever the device
    auto, off = CSBPOptions(), CSBPOptions(compile=False)
    assert compiles_drafter(auto, torch.device("cuda", 0)) and not compiles_drafter(auto, torch.device("cpu"))
    assert compiles_drafter(CSBPOptions(compile=True), torch.device("cpu"))
    assert not compiles_drafter(off, torch.device("cuda", 0))
    kept = prepare_run(_write(tmp_path), ["csbp.keep_logits_gib=6"], csbp=True)
    assert objective_for(kept.config, kept.options, 16).keep_logits_gib == 6.0
    assert objective_for(memory.config, memory.options, 16).keep_logits_gib == 0.0


def test_rank_sets_cp_fastest():
    assert rank_sets(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert rank_sets(3, 3) == ([[0, 1, 2]], [[0], [1], [2]])
    with pytest.raises(ValueError, match="--cp-size 3 does not divide the world size 4"):
        rank_sets(4, 3)


def _fake_store(tmp_path, layer_ids, hidden=64):
    from specforge_csbp.data.manifest import StoreManifest, TargetInfo
    from specforge_csbp.outputs import write_json_atomic

    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    manifest = StoreManifest(
        target=TargetInfo(name="t"), target_layer_ids=layer_ids, hidden_size=hidden, dtype="float32"
    )
    write_json_atomic(str(root / "manifest.json"), manifest.model_dump(mode="json"))


def test_preflight_rejects_a_store_captured_for_other_layers(tmp_path):
    _fake_store(tmp_path, [0, 2])
    run = prepare_run(_write(tmp_path), [], csbp=True, cp_size=2)
    with pytest.raises(
        ValueError,
        match=r"data.hidden_states_path: the feature store holds target layers \[0, 2\] "
        r"but model.draft_model_config needs dflash_config.target_layer_ids \[1, 3\]",
    ):
        preflight(run)  # fmt: skip
    _fake_store(tmp_path, [1, 3], hidden=32)
    with pytest.raises(
        ValueError, match="holds hidden size 32 but model.draft_model_config has hidden_size 64"
    ):
        preflight(run)
    _fake_store(tmp_path, [1, 3])
    preflight(run)


def test_preflight_refuses_flex_attention_without_a_gpu(tmp_path, monkeypatch):
    import torch

    _fake_store(tmp_path, [1, 3])
    run = prepare_run(_write(tmp_path, {"attention_backend": "flex_attention"}), [], csbp=True, cp_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as err:
        preflight(run)
    assert str(err.value).startswith("training.attention_backend=flex_attention: FlexAttention trains on GPUs")
    assert "allowed here: sdpa" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    preflight(run)  # with a GPU the same run passes this check


def test_preflight_points_specforge_records_at_the_converter(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "data_0.ckpt").write_bytes(b"x")
    run = prepare_run(_write(tmp_path, store="records"), [], csbp=True)
    with pytest.raises(
        ValueError,
        match="holds SpecForge offline records, not a CSBP feature store; convert once with "
        "`specforge-csbp import-specforge",
    ):
        preflight(run)  # fmt: skip


def test_console_script_prints_one_line_and_starts_nothing(tmp_path):
    path = _write(tmp_path, {"strategy": "eagle3"})
    script = os.path.join(os.path.dirname(sys.executable), "specforge")
    env = {k: v for k, v in os.environ.items() if k != "SPECFORGE_CSBP_DISABLE"}
    out = subprocess.run(
        [script, "train", "--csbp", "-c", path], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        (
            "specforge train: error: --csbp: training.strategy='eagle3' is not a DFlash-family algorithm; --csbp "
            "runs dflash and dflash2 configs (or set training.strategy to dflash-csbp / dflash2-csbp)"
        )
    ]


def test_plugin_algorithms_register_through_specforge_contract(tmp_path):
    from specforge.algorithms.contracts import FeatureMode
    from specforge.modeling.draft.registry import DRAFT_REGISTRY

    from specforge_csbp.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
    from specforge_csbp.plugin.registry import plugin_registry

    registry = plugin_registry()
    for name in ("dflash-csbp", "dflash2-csbp", "dflash2"):
        spec = registry.resolve(name).spec
        assert spec.feature_modes == frozenset(
            {FeatureMode.OFFLINE}
        )  # whole-sequence streaming is not offered
    assert {"eagle3", "dflash", "domino"} <= set(registry.names)  # SpecForge's own stay
    assert DRAFT_REGISTRY["DFlash2DraftModel"] is DFlash2DraftModel
    assert DRAFT_REGISTRY["CSBPDFlashDraftModel"] is DFlashDraftModel
    assert DRAFT_REGISTRY["DFlashDraftModel"] is not DFlashDraftModel  # SpecForge's class is not replaced

    from specforge.application import resolve_run

    _fake_store(tmp_path, [1, 3])
    run = prepare_run(_write(tmp_path), [], csbp=True, cp_size=2)
    assert resolve_run(run.config, registry=registry).algorithm.name == "dflash2-csbp"
    with pytest.raises(ValueError, match="algorithm 'dflash2-csbp' does not support attention_backend='usp'"):
        resolve_run(prepare_run(_write(tmp_path), ["training.attention_backend=usp", "training.sp_ring_size=2"],
                                csbp=True).config, registry=registry)  # fmt: skip
    json.dumps(run.forward_overrides)


def test_direct_entry_plans_torchrun_workers_that_run_this_package(tmp_path, capsys):
    from specforge_csbp.plugin.launch import train_main

    _fake_store(tmp_path, [1, 3])
    path = _write(tmp_path, nproc=2)
    assert (
        train_main(["--csbp", "-c", path, "--plan", "training.max_steps=5"], prog="specforge-csbp train") == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("specforge-csbp: dflash2-csbp on 2 rank(s): csbp over cp_size=2 x dp_replicas=1\n")
    argv = json.loads(out.split("\n", 1)[1])["commands"][0]["argv"]
    head = [
        sys.executable,
        "-m",
        "specforge_csbp.distributed.torchrun",  # torchrun's agent, quiet on failure
        "--no-python",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    assert argv[: len(head)] == head
    worker = argv[len(head) :]
    assert worker[:5] == [sys.executable, "-m", "specforge_csbp", "train", "--config"]
    assert worker[-3:] == ["training.max_steps=5", "training.strategy=dflash2-csbp", "csbp.cp_size=2"]
    assert train_main(["--csbp", "--cp-size", "3", "-c", path]) == 2
    assert capsys.readouterr().err.strip() == (
        "specforge-csbp train: error: --cp-size 3 does not divide the world size 2 "
        "(deployment.trainer.nnodes=1 x deployment.trainer.nproc_per_node=2)"
    )


@pytest.mark.parametrize("context", ["256k", "512k", "1m"])
def test_long_context_recipes_resolve(context):
    """The shipped long-context recipes stay valid SpecForge configs with their csbp sections."""
    run = prepare_run(os.path.join(ROOT, "examples", "long_context", f"qwen3.6-27b-dflash2-{context}.yaml"), [],
                      csbp=True)  # fmt: skip
    assert (run.strategy, run.world_size, run.cp_size, run.dp_replicas) == ("dflash2-csbp", 2, 2, 1)
    assert run.options.regather is False  # 1M fits without trading an all-gather for memory (docs/specforge.md)


def test_long_context_stage1_recipe_resolves():
    """Stage 1 of the long-context recipe: 8K tokens on one GPU, the same drafter config as its stage 2 files."""
    folder = os.path.join(ROOT, "examples", "long_context")
    run = prepare_run(os.path.join(folder, "qwen3.6-27b-dflash2-stage1-8k.yaml"), [], csbp=True)
    assert (run.strategy, run.world_size, run.cp_size, run.dp_replicas) == ("dflash2-csbp", 1, 1, 1)
    stage2 = prepare_run(os.path.join(folder, "qwen3.6-27b-dflash2-256k.yaml"), [], csbp=True)
    assert run.config.model.draft_model_config == stage2.config.model.draft_model_config
    assert run.config.data.max_length == 8192 < stage2.config.data.max_length
