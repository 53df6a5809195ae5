"""Eval during `specforge train --csbp` end to end (2 gloo ranks, CSBP cp_size 2, stock SpecForge 0.2.0):
`capture --eval-fraction` writes the eval store, `data.eval_hidden_states_path` + `training.eval_interval`
evaluate every 2 steps, and the run ends with bit-identical drafter weights and per-step losses to the same
run without eval (real AdamW, DDP, data order, RNG); eval/* metrics, est_tau and the per-slot accuracy reach
metrics.jsonl."""

from __future__ import annotations

import pytest
import json
import os

import torch
import yaml

from tests.plugin.test_end_to_end import ASSETS, DRAFTER, _train

STEPS = 4


def _logged(out_dir) -> list[dict]:
    """Every logged step's metrics of a run (plugin/reporting.py: <output_dir>/metrics.jsonl, rank 0)."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(out_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in _logged(out_dir) if "loss" in m}  # JSON floats round-trip exactly


@pytest.mark.slow(reason="two SpecForge training launches on 2 gloo ranks, with eval passes")
def test_eval_during_training_changes_nothing_it_trains(tmp_path):
    from specforge_csbp.cli.main import main as csbp_main
    from specforge_csbp.export.checkpoint import load_checkpoint

    assert csbp_main([
        "capture", "--target", os.path.join(ASSETS, "tiny_qwen3"), "--seed", "0", "--save-target", str(tmp_path / "target"),
        "--data", os.path.join(ASSETS, "tiny_chat.jsonl"), "--draft-config", DRAFTER, "--dtype", "float32",
        "--out", str(tmp_path / "store"), "--num-samples", "8", "--max-length", "128", "--no-progress",
        "--eval-fraction", "0.3",
    ]) == 0  # fmt: skip
    run = {
        "model": {"target_model_path": "target", "draft_model_config": DRAFTER, "torch_dtype": "float32"},
        "data": {"hidden_states_path": "store", "max_length": 128},
        "training": {"strategy": "dflash2", "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", "batch_size": 1,
                     "max_steps": STEPS, "learning_rate": 0.01, "warmup_ratio": 0.0, "num_anchors": 8,
                     "loss_decay_gamma": 4.0, "log_interval": 1, "seed": 3, "dist_timeout": 2},
        "deployment": {"trainer": {"nproc_per_node": 2}},
        "run_id": "ev", "output_dir": "plain-out",
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    plain = _train(["--csbp", "-c", "run.yaml"], str(tmp_path))
    evals = _train(["--csbp", "-c", "run.yaml", "data.eval_hidden_states_path=store-eval", "training.eval_interval=2",
                    "output_dir=eval-out"], str(tmp_path))  # fmt: skip
    a, b = _losses(tmp_path / "plain-out"), _losses(tmp_path / "eval-out")
    assert sorted(a) == list(range(1, STEPS + 1)) and a == b, (plain.stdout[-1500:], evals.stdout[-1500:])
    x, y = load_checkpoint(str(tmp_path / "plain-out")), load_checkpoint(str(tmp_path / "eval-out"))
    assert x.global_step == y.global_step == STEPS
    assert sorted(x.state_dict) == sorted(y.state_dict)
    assert all(torch.equal(x.state_dict[k], y.state_dict[k]) for k in x.state_dict)
    logged = _logged(tmp_path / "eval-out")
    evaluated = [m for m in logged if "eval/est_tau" in m]
    assert [m["step"] for m in evaluated] == [2, 4]
    assert all({"eval/avg_loss", "eval/avg_acc", "eval/slot_acc_1"} <= set(m) for m in evaluated)
    assert all(1.0 <= m["eval/est_tau"] <= 4.0 for m in evaluated)
    assert all("est_tau" in m and "tokens_per_micro_step" in m for m in logged if "loss" in m)
