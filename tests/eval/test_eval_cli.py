"""`specforge-csbp eval` end to end: drafter from a training output and from its SGLang export, prompts from
JSONL and from a feature store, the JSON fields other tools read, the PNG."""

from __future__ import annotations

import json
import os

import pytest
import torch

from transformers import AutoConfig

from specforge_csbp.assets import TINY_TARGET_DIR, materialize_tiny_target
from specforge_csbp.cli.main import main
from specforge_csbp.data.manifest import TargetInfo, config_hash
from specforge_csbp.data.store import FeatureStoreWriter
from specforge_csbp.eval import store_prompts
from specforge_csbp.export.writer import export_drafter
from tests.support.eval_fixtures import random_drafter, write_training_output

FIELDS = ("tau", "verify_steps", "generated_tokens", "block_size", "accept_hist", "per_slot_accept", "buckets",
          "drafter", "target")  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    target = materialize_tiny_target(str(root / "target"), seed=0)
    run = write_training_output(random_drafter(True, dtype=torch.float32), str(root / "run"))
    export_drafter(run, str(root / "export"), to="sglang")
    prompts = root / "prompts.jsonl"
    records = [
        {"input_ids": list(range(10, 40))},
        {"messages": [{"role": "user", "content": "How early should I book a night train?"},
                      {"role": "assistant", "content": "Early."}]},
        {"text": "The old town is best explored on foot."},
    ]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"root": root, "target": target, "run": run, "export": str(root / "export"), "prompts": str(prompts)}


def _eval(capsys, *args) -> tuple[int, str, str]:
    rc = main(["eval", "--no-progress", "--dtype", "float64", "--ignore-eos", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_training_output_and_export_give_the_same_result(files, capsys):
    results = []
    for name in ("run", "export"):
        out_json = files["root"] / f"{name}.json"
        rc, out, err = _eval(capsys, "--drafter", files[name], "--target", files["target"], "--prompts",
                             files["prompts"], "--max-new-tokens", "9", "--out", str(out_json))  # fmt: skip
        assert rc == 0, err
        assert out.startswith("tau="), out
        summary = json.loads(out_json.read_text())
        assert all(k in summary for k in FIELDS)
        assert summary["num_prompts"] == 3 and summary["generated_tokens"] == 27
        assert sum(summary["accept_hist"]) == summary["verify_steps"]
        assert os.path.getsize(out_json.with_suffix(".png")) > 1000
        results.append(summary)
    same = ("tau", "verify_steps", "accept_hist", "per_slot_accept", "buckets", "prompt_tokens")
    assert {k: results[0][k] for k in same} == {k: results[1][k] for k in same}


def test_untrained_baseline_runs_from_the_same_config(files, capsys, tmp_path):
    out_json = tmp_path / "u.json"
    rc, out, err = _eval(capsys, "--drafter", files["run"], "--target", files["target"], "--prompts",
                         files["prompts"], "--num-prompts", "1", "--max-new-tokens", "5", "--untrained",
                         "--out", str(out_json), "--plot", str(tmp_path / "u.png"))  # fmt: skip
    assert rc == 0, err
    summary = json.loads(out_json.read_text())
    assert summary["untrained"] is True and summary["num_prompts"] == 1
    assert (tmp_path / "u.png").is_file()


def _store(root, samples, target_layer_ids=(1, 3)):
    # the tiny target's own config hash: eval checks a store against --target before decoding
    info = TargetInfo(name="tiny", config_sha256=config_hash(AutoConfig.from_pretrained(TINY_TARGET_DIR)),
                      num_hidden_layers=6)  # fmt: skip
    with FeatureStoreWriter(str(root), target=info, target_layer_ids=list(target_layer_ids), hidden_size=64,
                            dtype="float32") as writer:  # fmt: skip
        for i, (ids, mask) in enumerate(samples):
            ids = torch.tensor(ids)
            writer.add(f"s{i}", ids, torch.tensor(mask), torch.zeros(len(ids), 128))


def test_store_prompts_stop_at_the_first_supervised_token(tmp_path):
    _store(tmp_path / "s", [([5, 6, 7, 8, 9], [0, 0, 1, 1, 1]), ([11, 12, 13], [1, 1, 1])])
    got = [p.tolist() for p in store_prompts(str(tmp_path / "s"))]
    assert got == [[5, 6], [11, 12, 13]]
    _store(tmp_path / "s" / "eval", [([21, 22, 23], [0, 1, 1])])
    assert [p.tolist() for p in store_prompts(str(tmp_path / "s"), split="eval")] == [[21]]
    with pytest.raises(ValueError, match="--split: the store at .* has no split 'test'"):
        store_prompts(str(tmp_path / "s"), split="test")


def test_store_prompts_drive_the_cli(files, capsys, tmp_path):
    _store(tmp_path / "s", [(list(range(20, 45)), [0] * 20 + [1] * 5)])
    rc, out, err = _eval(capsys, "--drafter", files["export"], "--target", files["target"], "--store",
                         str(tmp_path / "s"), "--max-new-tokens", "4")  # fmt: skip
    assert rc == 0, err
    assert "verify_steps=" in out and " prompts=1" in out
