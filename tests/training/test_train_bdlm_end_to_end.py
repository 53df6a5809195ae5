"""The generic trainer + `train-bdlm` end to end: 2 gloo ranks (CSBP) through the CLI, checked against the
single-process trainer (same recipe, cp_degree 1, no activation checkpointing), against gradient
accumulation, and against a resume from the CSBP run's first checkpoint. All in float64.

transformers' RMSNorms compute in float32 even for float64 models, so two partitions agree to float32
rounding of single rows (tests/models/bdlm/test_modes_equal_reference.py proves 1e-10 with float64 norms);
after two AdamW steps we allow 1e-7 relative - a wrong gradient or a lost micro batch is off by orders of
magnitude more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from specforge_csbp.cli.main import main
from specforge_csbp.models.bdlm.recipe import BDLMRecipe, build_workload, preflight
from specforge_csbp.training.config import load_recipe
from specforge_csbp.training.context import TrainContext
from specforge_csbp.training.trainer import train
from tests.support.spawned import one_rank_group

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SFT = str(EXAMPLES / "bdlm_sft_tiny.yaml")
CONVERT = str(EXAMPLES / "bdlm_convert_tiny.yaml")
COMMON = ["train.steps=2", "train.precision=float64", "train.save_every=1", "train.progress=false",
          "train.warmup_steps=1", "train.lr=1e-2"]  # fmt: skip
TOL = 1e-7


def _train_here(path: str, overrides: list[str]) -> list[dict]:
    recipe = load_recipe(BDLMRecipe, path, overrides + ["parallel.world_size=1", "parallel.cp_degree=1"])
    with one_rank_group():
        return train(build_workload(recipe), recipe.train, recipe.parallel)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / (run / "latest").read_text() / "model.safetensors"))


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def test_train_bdlm_csbp_matches_single_process(tmp_path, capsys):
    csbp = tmp_path / "csbp"
    # activation checkpointing on: the recompute re-runs the K/V all-gathers inside the backward
    assert (
        main(
            [
                "train-bdlm",
                "-c",
                SFT,
                *COMMON,
                f"train.output_dir={csbp}",
                "train.activation_checkpointing=true",
            ]
        )
        == 0
    )

    # atomic checkpoint layout: `latest` names the last complete directory, nothing temporary is left
    assert (csbp / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in csbp.iterdir()) == ["latest", "log.jsonl", "step_00000001", "step_00000002"]
    log = [json.loads(line) for line in (csbp / "log.jsonl").read_text().splitlines()]
    assert [m["step"] for m in log] == [1, 2]
    assert all(m["tokens_per_s"] > 0 and m["peak_mem_gib"] > 0 and m["loss"] > 0 for m in log)

    ref = tmp_path / "ref"
    history = _train_here(SFT, COMMON + [f"train.output_dir={ref}"])
    printed = capsys.readouterr().out
    assert "step 2/2 | loss" in printed and "tok/s" in printed and "mfu" in printed and "peak_mem" in printed
    assert abs(history[-1]["loss"] - log[-1]["loss"]) <= TOL * log[-1]["loss"]
    reference = _weights(ref)
    moved = _max_rel(_weights(csbp), load_file(str(csbp / "step_00000001" / "model.safetensors")))
    assert moved > 1e-4  # the second step changed the weights, so equality below means something
    assert _max_rel(_weights(csbp), reference) <= TOL

    # gradient accumulation (1 sequence x 2 micro steps) = one micro batch of 2 sequences
    acc = tmp_path / "acc"
    _train_here(SFT, COMMON + [f"train.output_dir={acc}", "train.micro_batch_size=1", "train.grad_accum=2"])
    assert _max_rel(_weights(acc), reference) <= TOL

    # resume the single-process run from the CSBP run's step-1 checkpoint
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(csbp / "step_00000001", resumed / "step_00000001")
    (resumed / "latest").write_text("step_00000001")
    history = _train_here(SFT, COMMON + [f"train.output_dir={resumed}"])
    assert [m["step"] for m in history] == [2]
    assert _max_rel(_weights(resumed), reference) <= TOL

    # checkpoints are Hugging Face directories
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(csbp / "step_00000002", dtype=torch.float64)
    saved = _weights(csbp)
    assert _max_rel({k: v for k, v in lm.state_dict().items() if k in saved}, saved) == 0.0

    # ... and a recipe can start from one (model.pretrained instead of model.config)
    recipe = load_recipe(BDLMRecipe, SFT, [f"model.pretrained={csbp / 'step_00000002'}", "model.config=null"])
    preflight(recipe, recipe.parallel.world_size)
    model = build_workload(recipe).make_model()
    assert _max_rel({k: v.double() for k, v in model.lm.state_dict().items() if k in saved}, saved) < 1e-6


def test_convert_recipe_trains_and_loss_falls(tmp_path):
    history = _train_here(CONVERT, ["train.steps=40", "train.progress=false", "train.lr=1e-2",
                                    f"train.output_dir={tmp_path}", "train.save_every=0"])  # fmt: skip
    losses = [m["loss"] for m in history]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses


def test_sequence_ids_are_partition_free():
    """dp x micro batch x accumulation splits of one global batch see the same sequence ids."""

    def ids(dp: int, micro: int, accum: int, step: int) -> list[int]:
        out = []
        for r in range(dp):
            ctx = TrainContext(
                rank=r,
                world_size=dp,
                dp_rank=r,
                dp_size=dp,
                cp_rank=0,
                cp_size=1,
                mode="reference",
                mesh=None,
                cp_group=None,
                dp_group=None,
                device=torch.device("cpu"),
                param_dtype=torch.float32,
                autocast_dtype=None,
                attention_backend="dense",
                seed=0,
                micro_batch_size=micro,
                grad_accum=accum,
            )
            out += [ctx.sequence_index(step, m, i) for m in range(accum) for i in range(micro)]
        return sorted(out)

    for step in (0, 3):
        expect = list(range(8 * step, 8 * step + 8))
        for split in ((1, 8, 1), (2, 4, 1), (2, 2, 2), (4, 1, 2), (8, 1, 1), (1, 1, 8)):
            assert ids(*split, step) == expect, split
