"""Nothing meaningless exits 0: each class of docs/reliability.md's "Artifacts a command combines" has one
mechanism, and each test here shows it catching the mistake at several entry points (one line, exit 2,
nothing written, before the work that would have used the input)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge_csbp.assets import TINY_TARGET_DIR, materialize_tiny_target
from specforge_csbp.cli.main import main
from specforge_csbp.data.manifest import TargetInfo
from specforge_csbp.data.store import FeatureStoreWriter
from tests.support.eval_fixtures import random_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_BDLM = os.path.join(ROOT, "examples", "bdlm_sft_tiny.yaml")
EVAL = ["eval", "--no-progress", "--ignore-eos", "--max-new-tokens", "8"]
CAPTURE = ["capture", "--no-progress", "--target-layer-ids", "1,3", "--max-length", "64"]
CHAT = {"messages": [{"role": "user", "content": "Is the museum open?"},
                     {"role": "assistant", "content": "Yes, from ten until six, and the garden is free."}]}  # fmt: skip


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """Tiny artifacts: a target, a drafter for it, and broken variants of both."""
    root = tmp_path_factory.mktemp("artifacts")
    materialize_tiny_target(str(root / "target"), seed=0)
    drafter = random_drafter(False, dtype=torch.float32)
    drafter.save_pretrained(str(root / "drafter"))
    with torch.no_grad():
        drafter.layers[0].mlp.down_proj.weight[1, 2] = float("nan")
    drafter.save_pretrained(str(root / "nan_drafter"))
    for name in ("zero_drafter", "config_only", "no_hidden"):
        (root / name).mkdir()
        shutil.copy(root / "drafter" / "config.json", root / name / "config.json")
    config = json.loads((root / "drafter" / "config.json").read_text())
    del config["hidden_size"]  # the class default would describe another drafter
    (root / "no_hidden" / "config.json").write_text(json.dumps(config))
    shutil.copy(root / "drafter" / "model.safetensors", root / "no_hidden" / "model.safetensors")
    (root / "zero_drafter" / "model.safetensors").write_bytes(b"")
    (root / "target_nocfg").mkdir()
    shutil.copy(root / "target" / "config.json", root / "target_nocfg" / "config.json")  # config, no weights
    (root / "target_zero").mkdir()
    shutil.copy(root / "target" / "config.json", root / "target_zero" / "config.json")
    (root / "target_zero" / "model.safetensors").write_bytes(b"")
    (root / "target_nan").mkdir()
    for name in os.listdir(root / "target"):
        shutil.copy(root / "target" / name, root / "target_nan" / name)
    weights = load_file(str(root / "target" / "model.safetensors"))
    key = sorted(k for k in weights if "mlp" in k)[0]
    weights[key][0, 0] = float("inf")
    save_file(weights, str(root / "target_nan" / "model.safetensors"), metadata={"format": "pt"})
    (root / "other").mkdir()  # another model: twice the hidden size
    cfg = json.loads((root / "target" / "config.json").read_text())
    (root / "other" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7, 8]}) + "\n")
    (root / "data.jsonl").write_text("".join(json.dumps({**CHAT, "id": f"r{i}"}) + "\n" for i in range(8)))
    return root


def _fails(capsys, argv, *expected) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert str(text) in err, err
    return err


def _store(root, sha, ids=("a", "b"), records=None, weights=None):
    """A feature store of the tiny target's layers 1, 3 (hidden 64) captured from a config hashing to `sha`
    (and weights fingerprinted `weights`)."""
    info = TargetInfo(name="t", config_sha256=sha, weights_sha256=weights, num_hidden_layers=6)
    with FeatureStoreWriter(str(root), target=info, target_layer_ids=[1, 3], hidden_size=64,
                            dtype="float32", overwrite=True) as w:  # fmt: skip
        for i, sid in enumerate(ids):
            w.add(sid, torch.arange(10 + i), torch.ones(10 + i, dtype=torch.long), torch.zeros(10 + i, 128),
                  record_sha256=(records or {}).get(sid))  # fmt: skip
    return str(root)


def _tiny_sha() -> str:
    from transformers import AutoConfig

    from specforge_csbp.data.manifest import config_hash

    return config_hash(AutoConfig.from_pretrained(TINY_TARGET_DIR))


# -- class 1: a meaningless result is refused (non-finite weights, empty work) -----------------------------
@pytest.mark.parametrize("case", ["eval", "export", "warm-start", "resume", "pretrained"])
def test_non_finite_weights_are_refused_wherever_they_are_loaded(art, case, capsys, tmp_path):
    if case == "eval":
        _fails(capsys, [*EVAL, "--drafter", art / "nan_drafter", "--target", art / "target", "--prompts",
                        art / "prompts.jsonl", "--out", tmp_path / "e.json"],  # fmt: skip
               "--drafter: ", "nan_drafter/model.safetensors: tensor 'layers.0.mlp.down_proj.weight' has 1 non-finite")
        _fails(capsys, [*EVAL, "--drafter", art / "drafter", "--target", art / "target_nan", "--prompts",
                        art / "prompts.jsonl"], "--target: ", "non-finite")  # fmt: skip
        assert not (tmp_path / "e.json").exists()
        return
    if case == "export":
        _fails(capsys, ["export", "--to", "sglang", art / "nan_drafter", tmp_path / "x"],
               "CHECKPOINT: ", "tensor 'layers.0.mlp.down_proj.weight'")  # fmt: skip
        assert not (tmp_path / "x").exists()
        return
    from specforge_csbp.plugin.checkpoints import check_resume_config, check_warm_start

    draft = json.loads((art / "drafter" / "config.json").read_text())
    if case == "warm-start":
        with pytest.raises(ValueError, match=r"model.draft_checkpoint_path: .*tensor 'layers.0.mlp.down_proj.weight'"):
            check_warm_start(str(art / "nan_drafter"), draft)
        check_warm_start(str(art / "drafter"), draft)  # finite: accepted
    if case == "resume":
        ckpt = tmp_path / "run-step2"
        ckpt.mkdir()
        state = load_file(str(art / "nan_drafter" / "model.safetensors"))
        torch.save({"strategy": "dflash2", "csbp_draft_config": json.dumps(draft), "draft_state_dict": state},
                   ckpt / "training_state.pt")  # fmt: skip
        with pytest.raises(ValueError, match=r"training.resume_from: .*training_state.pt: tensor 'layers.0.mlp"):
            check_resume_config(str(ckpt), draft)
    if case == "pretrained":
        from specforge_csbp.models.bdlm.adapter import BDLMModel

        with pytest.raises(ValueError, match=r"model.pretrained: .*target_nan: tensor '.*mlp.*' has 1 non-finite"):
            BDLMModel.from_pretrained(str(art / "target_nan"))


@pytest.mark.parametrize("case", ["eval-fraction-holds-none", "eval-held-out-all-skipped", "scenario-contexts",
                                  "eval-no-verify-step", "report-no-records"])  # fmt: skip
def test_work_that_comes_out_empty_is_an_error_not_a_result(art, case, capsys, tmp_path):
    if case == "eval-fraction-holds-none":  # 8 samples, 1% held out: none is; refused before the target loads
        _fails(capsys, [*CAPTURE, "--target", art / "target", "--data", art / "data.jsonl", "--out", tmp_path / "s",
                        "--eval-fraction", "0.01"], "--eval-fraction: 0.01 holds out none of the 8 samples")  # fmt: skip
        assert not (tmp_path / "s").exists()
    if case == "eval-held-out-all-skipped":  # every held-out record has no answer: the eval store is empty
        records = [{"id": f"r{i}", "text": "x"} if i % 2 else {**CHAT, "id": f"r{i}"} for i in range(8)]
        from specforge_csbp.data.split import held_out

        held = [r for r in records if held_out(r["id"], 0.5)]
        records = [({"id": r["id"], "messages": CHAT["messages"][:1]} if r in held else {**CHAT, "id": r["id"]})
                   for r in records]  # fmt: skip
        (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        _fails(capsys, [*CAPTURE, "--target", art / "target", "--data", tmp_path / "d.jsonl", "--out",
                        tmp_path / "s", "--eval-fraction", "0.5"], f"--eval-fraction: the store at {tmp_path}/s-eval holds no sample")  # fmt: skip
    if case == "scenario-contexts":
        from specforge_csbp.bench.scenarios import main as scenarios_main

        toml = tmp_path / "s.toml"
        toml.write_text('[a]\nbench = "drafter"\nruns = [{ contexts = ["64K"] }]\n')
        assert scenarios_main(["a", "--file", str(toml), "--contexts", "7K", "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert "--contexts: scenario a has no run at 7168 tokens; its runs are at 64K" in err, err
    if case == "report-no-records":  # an empty page would replace the report that was there
        (tmp_path / "results").mkdir()
        (tmp_path / "b.md").write_text("the old report\n")
        _fails(capsys, ["report", "--results", tmp_path / "results", "--out", tmp_path / "b.md"],
               f"--results: {tmp_path}/results holds no benchmark records")  # fmt: skip
        assert (tmp_path / "b.md").read_text() == "the old report\n"
    if case == "eval-no-verify-step":
        _fails(capsys, [*EVAL[:-1], "1", "--drafter", art / "drafter", "--target", art / "target", "--prompts",
                        art / "prompts.jsonl", "--out", tmp_path / "e.json"],  # fmt: skip
               "eval: no verify step ran, so there is no tau to report: --max-new-tokens 1")
        assert not (tmp_path / "e.json").exists()


# -- class 2: two artifacts that do not belong together (compat.check_pair) -----------------------------------
@pytest.mark.parametrize("case", ["eval-drafter-target", "export-target", "eval-store-target",
                                  "capture-resume-fraction"])  # fmt: skip
def test_artifacts_that_do_not_belong_together_are_named_with_the_first_differing_fact(art, case, capsys, tmp_path):
    if case == "eval-drafter-target":
        _fails(capsys, [*EVAL, "--drafter", art / "drafter", "--target", art / "other", "--prompts",
                        art / "prompts.jsonl"],  # fmt: skip
               f"--drafter {art}/drafter and --target {art}/other do not belong together: hidden_size is 64 in "
               "--drafter but 128 in --target")
    if case == "export-target":
        _fails(capsys, ["export", "--to", "sglang", art / "drafter", tmp_path / "x", "--target", art / "other"],
               "do not belong together: hidden_size is 64 in CHECKPOINT but 128 in --target")  # fmt: skip
        _fails(capsys, ["export", "--to", "sglang", art / "drafter", tmp_path / "x", "--target", tmp_path / "typo"],
               f"--target: {tmp_path}/typo does not exist")  # fmt: skip
        assert not (tmp_path / "x").exists()
    if case == "eval-store-target":
        store = _store(tmp_path / "store", "f" * 64)
        _fails(capsys, [*EVAL, "--drafter", art / "drafter", "--target", art / "target", "--store", store],
               f"--store {store} and --target {art}/target do not belong together: target_config_sha256")  # fmt: skip
    if case == "capture-resume-fraction":
        out = tmp_path / "s"
        assert main([*CAPTURE, "--target", str(art / "target"), "--data", str(art / "data.jsonl"), "--out", str(out),
                     "--eval-fraction", "0.5"]) == 0  # fmt: skip
        capsys.readouterr()
        _fails(capsys, [*CAPTURE, "--target", art / "target", "--data", art / "data.jsonl", "--out", out, "--resume",
                        "--eval-fraction", "0.2"], "--resume: the store at", "would put in the other store")  # fmt: skip


@pytest.mark.parametrize("case", ["eval-store-other-target", "eval-store-shares-samples", "drafter-other-target"])
def test_the_drafter_launcher_checks_the_eval_store_before_any_worker(case, tmp_path, capsys):
    from specforge_csbp.plugin.launch import train_main
    from tests.reliability.test_mechanisms import _run_config

    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(os.path.join(TINY_TARGET_DIR, "config.json"), target / "config.json")
    sha = _tiny_sha() if case != "eval-store-other-target" else "e" * 64
    if case == "drafter-other-target":  # the stores are this (other) target's; the drafter config is not
        from transformers import AutoConfig

        from specforge_csbp.data.manifest import config_hash

        cfg = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
        sha = config_hash(AutoConfig.from_pretrained(str(target)))
    # the training store's record of sample 'ok', captured again under another id: the same record in both
    # stores, found by its record hash (capture's record_sha256)
    record = "d" * 64
    _store(tmp_path / "store", sha if case == "drafter-other-target" else _tiny_sha(), ids=("ok", "late"),
           records={"ok": record})  # fmt: skip
    _store(tmp_path / "ev", sha, ids=("r9",), records={"r9": record if case != "drafter-other-target" else "x"})
    path = _run_config(tmp_path, {"eval_interval": 1})
    data = __import__("yaml").safe_load(open(path))
    data["data"]["eval_hidden_states_path"] = str(tmp_path / "ev")
    open(path, "w").write(__import__("yaml").safe_dump(data))
    rc = train_main(["--csbp", "-c", path, "--plan"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    expected = {
        "eval-store-other-target": "its config is not the one the feature store (data.eval_hidden_states_path) was",
        "eval-store-shares-samples": f"data.eval_hidden_states_path={tmp_path}/ev and data.hidden_states_path="
                                     f"{tmp_path}/store share 1 sample(s) (first: 'r9' in data.eval_hidden_states_path, "
                                     "'ok' in data.hidden_states_path)",
        "drafter-other-target": f"and model.target_model_path={target} do not belong together: hidden_size is 64 in "
                                "model.draft_model_config but 128 in model.target_model_path",
    }[case]  # fmt: skip
    assert expected in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["train", "resume", "export", "eval-export", "eval-checkpoint", "eval-store",
                                  "capture-resume"])  # fmt: skip
def test_a_target_of_the_same_config_with_other_weights_is_named_wherever_it_meets_its_artifacts(
    art, case, capsys, tmp_path
):
    """Another fine-tune of one config passes every config check: the weights fingerprint (data/fingerprint.py)
    recorded in the store, the plugin checkpoint and the export tells it apart, at every command."""
    from specforge_csbp.data.fingerprint import weights_fingerprint

    other = tmp_path / "other_weights"  # the tiny target's config, seed 1's weights
    materialize_tiny_target(str(other), seed=1)
    capsys.readouterr()  # its save's progress bar
    ours, theirs = weights_fingerprint(str(art / "target")), weights_fingerprint(str(other))
    assert None not in (ours, theirs) and ours != theirs
    target_record = json.dumps({"config_sha256": _tiny_sha(), "weights_sha256": ours}, sort_keys=True)
    said = f"weights fingerprint {ours[:12]}"
    if case == "train":  # the launcher, before any worker: store captured from `target`, run names `other`
        from specforge_csbp.plugin.launch import train_main
        from tests.reliability.test_mechanisms import _run_config

        _store(tmp_path / "store", _tiny_sha(), weights=ours)
        path = _run_config(tmp_path, model={"target_model_path": str(other)})
        assert train_main(["--csbp", "-c", path, "--plan"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert (f"model.target_model_path={other}: its weights are not the ones the feature store "
                f"(data.hidden_states_path) was captured from (t; weights fingerprint {theirs[:12]} here, "
                f"{ours[:12]} in the store)") in err, err  # fmt: skip
        assert not (tmp_path / "out").exists()
        return
    if case == "capture-resume":
        out = tmp_path / "s"
        assert main([*CAPTURE, "--target", str(art / "target"), "--data", str(art / "data.jsonl"), "--out",
                     str(out)]) == 0  # fmt: skip
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["target"]["weights_sha256"] == ours
        capsys.readouterr()
        _fails(capsys, [*CAPTURE, "--target", other, "--data", art / "data.jsonl", "--out", out, "--resume"],
               f"resume: the store at {out} was captured from a different target")  # fmt: skip
        return
    if case == "eval-store":
        store = _store(tmp_path / "store", _tiny_sha(), weights=ours)
        _fails(capsys, [*EVAL, "--drafter", art / "drafter", "--target", other, "--store", store],
               f"--store {store} and --target {other} do not belong together: target_weights_sha256 is {said} "
               "in --store")  # fmt: skip
        return
    draft = json.loads((art / "drafter" / "config.json").read_text())
    checkpoint = tmp_path / "run-step2"  # a plugin checkpoint of a drafter trained for `target`
    checkpoint.mkdir()
    torch.save({"strategy": "dflash2", "csbp_draft_config": json.dumps(draft), "global_step": 2,
                "draft_state_dict": load_file(str(art / "drafter" / "model.safetensors")),
                "csbp_target": target_record}, checkpoint / "training_state.pt")  # fmt: skip
    if case == "resume":
        from types import SimpleNamespace

        from specforge_csbp.objectives.dflash import DFlashObjective
        from specforge_csbp.plugin.checkpoints import check_resume_target
        from specforge_csbp.plugin.registry import resume_contract

        check_resume_target(str(checkpoint), target_record)  # its own target: accepted
        mine = json.dumps({"config_sha256": _tiny_sha(), "weights_sha256": theirs}, sort_keys=True)
        with pytest.raises(ValueError, match=rf"^training.resume_from: its drafter was trained for a target with "
                                             rf"weights fingerprint {ours[:12]}, this run's target has {theirs[:12]}"):
            check_resume_target(str(checkpoint), mine)
        # what a run saves: the store's record of its target (the contract SpecForge writes into each checkpoint)
        from specforge_csbp.data.store import FeatureStore

        store = FeatureStore(_store(tmp_path / "store", _tiny_sha(), weights=ours), verify="trust")
        cfg = SimpleNamespace(model=SimpleNamespace(target_model_path=str(other)),
                              training=SimpleNamespace(resume_from=None))  # fmt: skip
        parts = (SimpleNamespace(config=SimpleNamespace(to_dict=lambda: draft)),
                 SimpleNamespace(objective=DFlashObjective(num_anchors=4), store=store))  # fmt: skip
        assert resume_contract("dflash2", cfg, *parts)["csbp_target"] == target_record
        cfg.training.resume_from = str(checkpoint)
        assert resume_contract("dflash2", cfg, *parts)["csbp_target"] == target_record
        # a checkpoint written before targets were recorded resumes as written: SpecForge refuses a contract
        # key its checkpoint lacks, so the key is left out of the contract (and of the checkpoints it writes)
        state = torch.load(checkpoint / "training_state.pt", weights_only=False)
        del state["csbp_target"]
        torch.save(state, checkpoint / "training_state.pt")
        check_resume_target(str(checkpoint), mine)  # nothing to compare
        assert "csbp_target" not in resume_contract("dflash2", cfg, *parts)
        return
    if case == "export":
        _fails(capsys, ["export", "--to", "sglang", checkpoint, tmp_path / "x", "--target", other],
               f"CHECKPOINT {checkpoint} and --target {other} do not belong together: target_weights_sha256 is "
               f"{said} in CHECKPOINT but weights fingerprint {theirs[:12]} in --target")  # fmt: skip
        assert not (tmp_path / "x").exists()
        return
    drafter = checkpoint
    if case == "eval-export":  # the export carries the checkpoint's record into provenance.json
        drafter = tmp_path / "exported"
        assert main(["export", "--to", "sglang", str(checkpoint), str(drafter), "--target", str(art / "target")]) == 0
        provenance = json.loads((drafter / "provenance.json").read_text())
        assert provenance["source"]["csbp_target"] == json.loads(target_record)
        capsys.readouterr()
    _fails(capsys, [*EVAL, "--drafter", drafter, "--target", other, "--prompts", art / "prompts.jsonl", "--out",
                    tmp_path / "e.json"],  # fmt: skip
           f"--drafter {drafter} and --target {other} do not belong together: target_weights_sha256 is {said}")
    assert not (tmp_path / "e.json").exists()
    # its own target: evaluated
    assert main([*EVAL, "--drafter", str(drafter), "--target", str(art / "target"), "--prompts",
                 str(art / "prompts.jsonl"), "--out", str(tmp_path / "e.json")]) == 0  # fmt: skip


# -- class 3: outputs checked before the work that fills them ------------------------------------------------
@pytest.mark.parametrize("case", ["eval-out", "eval-plot-dir", "export-out", "capture-out", "report-out",
                                  "train-bdlm-output-dir"])  # fmt: skip
def test_every_output_is_checked_for_writability_before_the_work(art, case, capsys, tmp_path, monkeypatch):
    # /proc refuses new files even to root (whose permission bits say nothing): the check creates a probe file
    eval_args = [*EVAL, "--drafter", art / "drafter", "--target", art / "target", "--prompts", art / "prompts.jsonl"]
    import specforge_csbp.eval.run as eval_run

    monkeypatch.setattr(eval_run, "run_prompts", lambda *a, **k: pytest.fail("decoded before checking --out"))
    argv, expected = {
        "eval-out": ([*eval_args, "--out", "/proc/e.json"], "--out: /proc is not writable"),
        "eval-plot-dir": ([*eval_args, "--plot", tmp_path], f"--plot: {tmp_path} is a directory; give a file name"),
        "export-out": (["export", "--to", "hf", art / "drafter", "/proc/x"], "OUT: /proc is not writable"),
        "capture-out": ([*CAPTURE, "--target", art / "target", "--data", art / "data.jsonl", "--out", "/proc/s"],
                        "--out: /proc/s cannot be created: /proc is not writable"),
        "report-out": (["report", "--results", tmp_path, "--out", "/proc/b.md"], "--out: /proc is not writable"),
        "train-bdlm-output-dir": (["train-bdlm", "-c", TINY_BDLM, "train.output_dir=/proc/run"],
                                  "train.output_dir: /proc/run cannot be created: /proc is not writable"),
    }[case]  # fmt: skip
    err = _fails(capsys, argv, expected)
    assert "rank" not in err  # the launcher's check, not a rank's


# -- class 4: the wrong thing named -> the file and the flag ------------------------------------------------------
@pytest.mark.parametrize("case", ["eval-zero-weights", "export-zero-weights", "eval-config-only", "eval-swapped",
                                  "export-swapped", "capture-swapped", "pretrained-no-weights",
                                  "pretrained-zero-weights", "export-config-field-missing"])  # fmt: skip
def test_a_broken_or_misplaced_artifact_names_its_file_and_flag(art, case, capsys, tmp_path):
    prompts = ["--prompts", art / "prompts.jsonl"]
    argv, expected = {
        "eval-zero-weights": ([*EVAL, "--drafter", art / "zero_drafter", "--target", art / "target", *prompts],
                              f"--drafter: {art}/zero_drafter/model.safetensors is empty (0 bytes)"),
        "export-zero-weights": (["export", "--to", "vllm", art / "zero_drafter", tmp_path / "x"],
                                f"CHECKPOINT: {art}/zero_drafter/model.safetensors is empty (0 bytes)"),
        "export-config-field-missing": (["export", "--to", "sglang", art / "no_hidden", tmp_path / "x"],
                                        f"CHECKPOINT: {art}/no_hidden/config.json has no hidden_size; a drafter "
                                        "config names its shapes"),
        "eval-config-only": ([*EVAL, "--drafter", art / "config_only", "--target", art / "target", *prompts],
                             f"--drafter: {art}/config_only has a config.json but no weights"),
        "eval-swapped": ([*EVAL, "--drafter", art / "target", "--target", art / "drafter", *prompts],
                         f"--target: {art}/drafter is a drafter (DFlashDraftModel), not a target model; were the "
                         "drafter and the target swapped?"),
        "export-swapped": (["export", "--to", "sglang", art / "target", tmp_path / "x"],
                           "is not a CSBP drafter (architectures ['Qwen3ForCausalLM'];"),
        "capture-swapped": ([*CAPTURE, "--target", art / "drafter", "--data", art / "data.jsonl", "--out",
                             tmp_path / "s"], f"--target: {art}/drafter is a drafter (DFlashDraftModel)"),
        "pretrained-no-weights": (["train-bdlm", "-c", TINY_BDLM, "model.config=null",
                                   f"model.pretrained={art}/target_nocfg", f"train.output_dir={tmp_path}/r"],
                                  f"model.pretrained: {art}/target_nocfg has no weights"),
        "pretrained-zero-weights": (["train-bdlm", "-c", TINY_BDLM, "model.config=null",
                                     f"model.pretrained={art}/target_zero", f"train.output_dir={tmp_path}/r"],
                                    f"model.pretrained: {art}/target_zero/model.safetensors is empty (0 bytes)"),
    }[case]  # fmt: skip
    _fails(capsys, argv, expected)
    assert not any(tmp_path.iterdir())


# -- class 5: a line, never a traceback ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["eval-nested-ids", "capture-nested-ids", "eval-bool-ids", "eval-messages-string",
                                  "eval-text-number", "capture-float-ids"])  # fmt: skip
def test_a_malformed_record_is_one_line_in_every_reader(art, case, capsys, tmp_path):
    record = {
        "eval-nested-ids": {"input_ids": [[5, 6], [7, 8]]}, "capture-nested-ids": {"input_ids": [[5, 6], [7, 8]]},
        "eval-bool-ids": {"input_ids": [True, 5]}, "eval-messages-string": {"messages": "hello"},
        "eval-text-number": {"text": 42}, "capture-float-ids": {"input_ids": [5, 2.7, 9]},
    }[case]  # fmt: skip
    (tmp_path / "r.jsonl").write_text(json.dumps(record) + "\n")
    if case.startswith("eval"):
        argv = [*EVAL, "--drafter", art / "drafter", "--target", art / "target", "--prompts", tmp_path / "r.jsonl"]
    else:
        argv = [*CAPTURE, "--target", art / "target", "--data", tmp_path / "r.jsonl", "--out", tmp_path / "s"]
    expected = {
        "eval-nested-ids": "input_ids must be a non-empty list of non-negative integers (token ids) (a list of lists",
        "capture-nested-ids": "(a list of lists: give one prompt per record); got [[5, 6], [7, 8]]",
        "eval-bool-ids": "input_ids must be a non-empty list of non-negative integers",
        "eval-messages-string": "--prompts: messages: ",
        "eval-text-number": "text must be a non-empty string; got 42",
        "capture-float-ids": "must be a non-empty list of non-negative integers (token ids); got [5, 2.7, 9]",
    }[case]  # fmt: skip
    _fails(capsys, argv, f"{tmp_path}/r.jsonl", expected)


# -- class 6: one spelling of a value everywhere (values.py) ------------------------------------------------------
def test_a_size_is_spelled_the_same_on_every_flag_field_and_override(tmp_path, capsys):
    from specforge_csbp.cli.main import build_parser
    from specforge_csbp.models.bdlm.recipe import BDLMRecipe
    from specforge_csbp.training.config import load_recipe

    parser = build_parser()
    flags = {
        ("capture", "--max-length"): ["--target", "t", "--data", "d", "--out", "o"],
        ("capture", "--chunk-size"): ["--target", "t", "--data", "d", "--out", "o"],
        ("eval", "--max-new-tokens"): ["--drafter", "d", "--target", "t", "--prompts", "p"],
        ("eval", "--prefill-chunk"): ["--drafter", "d", "--target", "t", "--prompts", "p"],
        ("import-specforge", "--max-length"): ["src", "out"],
        ("verify", "--seq-len"): [],
    }
    for (command, flag), rest in flags.items():
        args = parser.parse_args([command, *rest, flag, "4K"])
        assert getattr(args, flag.lstrip("-").replace("-", "_")) == 4096, (command, flag)
        err = _fails(capsys, [command, *rest, flag, "4Q"], f"specforge-csbp {command}: error: argument {flag}: ",
                     "with an optional K/M/G suffix")  # fmt: skip
        assert "usage:" not in err
    # a recipe field: the YAML spelling and the override spelling give the same value
    (tmp_path / "r.yaml").write_text(open(TINY_BDLM).read().replace("max_length: 64 ", "max_length: 1K "))
    from_yaml = load_recipe(BDLMRecipe, str(tmp_path / "r.yaml"))
    from_override = load_recipe(BDLMRecipe, TINY_BDLM, ["data.max_length=1K", "objective.ce_chunk_size=2K"])
    assert from_yaml.data.max_length == from_override.data.max_length == 1024
    assert from_override.objective.ce_chunk_size == 2048
    with pytest.raises(ValueError, match=r"data.max_length: must be an integer with an optional K/M/G suffix"):
        load_recipe(BDLMRecipe, TINY_BDLM, ["data.max_length=1KB"])
    # context lists of the sweep and the planner, integer lists of capture and the sweep: one parser each
    from specforge_csbp.cli.capture import parse_layer_ids
    from specforge_csbp.values import parse_sizes

    assert parse_sizes("64K,1M, 4096") == [4096, 65536, 1 << 20]
    assert parse_layer_ids("1, 3,5") == parse_layer_ids("[1, 3, 5]") == [1, 3, 5]  # the YAML list spelling too
    _fails(capsys, ["capture", "--target", "t", "--data", "d", "--out", "o", "--target-layer-ids", "1;3"],
           "--target-layer-ids: expected comma-separated integers >= 0 like 1,3,5; got '1;3'")  # fmt: skip
    _fails(capsys, ["sweep", "--out-dir", tmp_path / "sw", "--world-sizes", "2,x", "--dry-run"],
           "--world-sizes: expected comma-separated integers >= 1 like 1,3,5; got '2,x'")  # fmt: skip
    _fails(capsys, ["plan", "--model", os.path.join(ROOT, "benchmarks", "configs", "qwen3-1.7b.json"), "--context", "12Q"], "--context must be an integer >= 1 with an optional K/M/G suffix")


def test_a_csbp_override_reads_its_value_as_the_yaml_does(tmp_path):
    from tests.reliability.test_mechanisms import DRAFTER

    from specforge_csbp.plugin.options import prepare_run

    raw = {
        "model": {"target_model_path": str(tmp_path), "draft_model_config": DRAFTER},
        "data": {"hidden_states_path": str(tmp_path / "store")},
        "training": {"strategy": "dflash2-csbp", "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa"},
        "output_dir": str(tmp_path / "out"),
    }
    import yaml

    for text, value in (("true", True), ("false", False), ("auto", "auto"), ("yes", True)):
        path = tmp_path / f"{text}.yaml"
        path.write_text(yaml.safe_dump({**raw, "csbp": {"compile": yaml.safe_load(text), "bucket": 4}}))
        in_yaml = prepare_run(str(path), [], csbp=True).options
        path.write_text(yaml.safe_dump(raw))
        overridden = prepare_run(str(path), [f"csbp.compile={text}", "csbp.bucket=4"], csbp=True).options
        assert in_yaml.compile == overridden.compile == value
        assert in_yaml == overridden
