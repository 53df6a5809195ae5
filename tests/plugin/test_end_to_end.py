"""End to end, as a user runs it: capture a tiny store, `specforge train --csbp` on 2 gloo ranks through the
installed start-up hook and stock SpecForge 0.2.0, the same run without --csbp on one rank, then an SGLang
export checked against SGLang's loader contract and reloaded with identical outputs.

    capture (8 samples) -> store
    specforge train --csbp -c run.yaml csbp.compile=true        2 ranks, batch 1/rank, dflash2-csbp, cp = 2
    specforge train -c run.yaml nproc_per_node=1 batch_size=2   1 rank,  batch 2,      dflash2 (plain DP)
        same samples per step (SpecForge's sampler), same anchors (seed, step, sample) -> same losses, every step
    specforge-csbp export --to sglang <output_dir> OUT          contract + provenance + reload equivalence
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "specforge_csbp", "assets")
DRAFTER = os.path.join(ROOT, "examples", "quickstart_drafter.json")
STEPS = 3


def _losses(stdout: str) -> dict[int, float]:
    out = {}
    for step, payload in re.findall(r"^step (\d+): (\{.*\})$", stdout, flags=re.MULTILINE):
        out[int(step)] = float(ast.literal_eval(payload)["loss"])
    return out


def _train(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    script = os.path.join(os.path.dirname(sys.executable), "specforge")
    env = {k: v for k, v in os.environ.items() if k != "SPECFORGE_CSBP_DISABLE"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [script, "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.mark.slow(reason="specforge train --csbp on 2 gloo ranks, then export and SGLang's loader contract")
def test_specforge_train_csbp_then_sglang_export(tmp_path):
    from specforge_csbp.cli.main import main as csbp_main

    assert csbp_main([
        "capture", "--target", os.path.join(ASSETS, "tiny_qwen3"), "--seed", "0", "--save-target", str(tmp_path / "target"),
        "--data", os.path.join(ASSETS, "tiny_chat.jsonl"), "--draft-config", DRAFTER, "--dtype", "float32",
        "--out", str(tmp_path / "store"), "--num-samples", "8", "--max-length", "256", "--no-progress",
    ]) == 0  # fmt: skip
    run = {
        "model": {"target_model_path": "target", "draft_model_config": DRAFTER, "torch_dtype": "float32"},
        "data": {"hidden_states_path": "store", "max_length": 256},
        "training": {"strategy": "dflash2", "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa", "batch_size": 1,
                     "max_steps": STEPS, "learning_rate": 0.01, "warmup_ratio": 0.0, "num_anchors": 8,
                     "loss_decay_gamma": 4.0, "log_interval": 1, "seed": 3, "dist_timeout": 2},
        "deployment": {"trainer": {"nproc_per_node": 2}},
        "run_id": "e2e", "output_dir": "csbp-out",
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))

    # the CSBP run with the drafter's token-wise chains compiled (the GPU default), the reference eager
    csbp = _train(["--csbp", "-c", "run.yaml", "csbp.compile=true"], str(tmp_path))
    assert "dflash2-csbp on 2 rank(s): csbp over cp_size=2 x dp_replicas=1" in csbp.stdout
    assert "csbp.compile -> the drafter's token-wise chains compiled" in csbp.stdout
    ref = _train(["-c", "run.yaml", "deployment.trainer.nproc_per_node=1", "training.batch_size=2",
                  "output_dir=ref-out"], str(tmp_path))  # fmt: skip
    assert "dflash2 on 1 rank(s): data parallel" in ref.stdout
    a, b = _losses(csbp.stdout), _losses(ref.stdout)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (csbp.stdout[-1500:], ref.stdout[-1500:])
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6 * abs(b[step]), (step, a[step], b[step])
    assert len({round(v, 4) for v in a.values()}) > 1  # the steps really trained (the loss moved)

    from safetensors.torch import load_file

    from specforge_csbp.export.checkpoint import load_checkpoint
    from specforge_csbp.export.sglang_contract import check_export
    from specforge_csbp.export.writer import export_drafter, load_exported
    from specforge_csbp.models.dflash.modeling import DFlash2DraftModel
    from specforge_csbp.outputs import file_sha256
    from specforge_csbp.models.dflash.sharding import reference_attention

    out = tmp_path / "drafter-sglang"
    result = export_drafter(str(tmp_path / "csbp-out"), str(out), to="sglang")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    report = check_export(config, {k: tuple(v.shape) for k, v in weights.items()})
    assert (
        report.ok
        and result.architecture == "DFlash2DraftModel"
        and config["dflash_config"]["target_layer_ids"] == [1, 3]
    )
    ckpt = load_checkpoint(str(tmp_path / "csbp-out"))
    assert ckpt.strategy == "dflash2-csbp" and ckpt.global_step == STEPS
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["source"]["sha256"] == file_sha256(ckpt.source)
    assert provenance["source"]["strategy"] == "dflash2-csbp" and provenance["files"]["model.safetensors"]
    # the drafter carries the target it was trained for: the saved target's weights, as the store recorded them
    from specforge_csbp.data.fingerprint import weights_fingerprint

    captured = json.loads((tmp_path / "store" / "manifest.json").read_text())["target"]
    assert captured["weights_sha256"] == weights_fingerprint(str(tmp_path / "target")) is not None
    assert provenance["source"]["csbp_target"] == {k: captured[k] for k in ("config_sha256", "weights_sha256")}

    trained = DFlash2DraftModel(ckpt.config)
    trained.load_state_dict(ckpt.state_dict)
    reloaded = load_exported(str(out))
    assert type(reloaded) is DFlash2DraftModel
    g = torch.Generator().manual_seed(0)
    S, H, L = trained.block_size, trained.config.hidden_size, 40
    anchors = torch.tensor([5, 17, 30])
    positions = (anchors[:, None] + torch.arange(S)).reshape(-1)
    args = (
        torch.randn(1, anchors.numel() * S, H, generator=g),
        positions,
        torch.randn(1, L, 2 * H, generator=g),
        torch.arange(L),
        reference_attention(trained.config, anchors, torch.arange(L)),
    )
    with torch.no_grad():
        assert torch.equal(trained.eval()(*args), reloaded.eval()(*args))
