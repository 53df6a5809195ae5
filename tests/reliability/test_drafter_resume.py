"""Exact resume and resharding of the DFlash drafter path (`specforge train --csbp`, SpecForge 0.2.0's own
loop and checkpoints), CPU, float32, 2 gloo ranks under SpecForge's torchrun launch:

    uninterrupted  cp=2   1 2 [ckpt 2] 3 4 [ckpt 4]
    killed         cp=2   1 2 [ckpt 2] 3x          (rank 1 SIGKILLed inside step 3's forward)
      resumed      cp=2             -> 3 4         same per-step loss, bit for bit; same final weights, bit for bit
    resharded      cp=1 (2 DP replicas), resumed from the uninterrupted run's step 2
                                    -> 3 4         loaded weights = the checkpoint's; losses = the cp=2 run's (1e-6)

Why bit-identical is possible: SpecForge's checkpoint restores the drafter weights, the fp32 masters, AdamW
moments, scheduler position, every rank's torch RNG and the sampler position (epoch, samples); the plugin's
anchors are a pure function of (training.seed, global step, store index), so nothing a step reads differs.
The kill comes from a test-only `sitecustomize` (on PYTHONPATH) that patches the strategy in the workers.
"""

from __future__ import annotations

import pytest
import os
import subprocess
import sys
import textwrap

import torch
import yaml

from tests.plugin.test_end_to_end import ASSETS, DRAFTER, _losses

STEPS = 4
RUN_ID = "rel"

# A worker-side patch, active only when CSBP_TEST_FAULT is set: "kill:RANK:STEP" SIGKILLs that rank in the
# forward of that (1-based) step, "raise:RANK:STEP" raises there; "nan:RANK:STEP:loss" makes that rank's loss
# numerator NaN and "nan:RANK:STEP:PARAM" that rank's gradient of drafter parameter PARAM inf.
SITECUSTOMIZE = textwrap.dedent("""
    import os
    _fault = os.environ.get("CSBP_TEST_FAULT")
    if _fault:  # every process of the run; only a training forward can hit (one rank runs in the CLI's process)
        import signal
        import torch
        from specforge_csbp.plugin import training_model as _m

        _kind, _rank, _step, *_rest = _fault.split(":")
        _original = _m.CSBPDrafterTrainingModel.forward

        def forward(self, sample_index, global_step=0):
            hit = int(os.environ.get("RANK", "0")) == int(_rank) and int(global_step) + 1 == int(_step)
            if hit and _kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if hit and _kind == "raise":
                raise RuntimeError("injected crash")
            numerator, denominator, stats = _original(self, sample_index, global_step)
            if hit and _kind == "nan" and _rest[0] == "loss":
                numerator = numerator * float("nan")
            elif hit and _kind == "nan":  # this rank's gradient of one parameter becomes inf, once
                param = dict(self.draft_model.named_parameters())[_rest[0]]
                handle = []
                def poison(grad):
                    handle[0].remove()
                    return grad * float("inf")
                handle.append(param.register_hook(poison))
            return numerator, denominator, stats

        _m.CSBPDrafterTrainingModel.forward = forward
""")


def _env(tmp: str, fault: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECFORGE_CSBP_DISABLE", "CSBP_TEST_FAULT")}
    env["CSBP_TEST_MARK"] = tmp  # finds any process a run left behind
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([tmp, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if fault:
        env["CSBP_TEST_FAULT"] = fault
    return env


def specforge_train(args: list[str], cwd, fault: str | None = None, timeout: int = 300):
    """`specforge train ARGS` in cwd (sitecustomize.py there), returning the finished process."""
    script = os.path.join(os.path.dirname(sys.executable), "specforge")
    return subprocess.run(
        [script, "train", *args], cwd=str(cwd), env=_env(str(cwd), fault), capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def build_run(tmp_path, *, steps: int = STEPS, samples: int = 8, save_interval: int = 2) -> None:
    """The tiny bundled target + store (as in tests/plugin/test_end_to_end.py), run.yaml and the fault
    sitecustomize."""
    from specforge_csbp.cli.main import main as csbp_main

    assert csbp_main([
        "capture", "--target", os.path.join(ASSETS, "tiny_qwen3"), "--seed", "0", "--save-target", str(tmp_path / "target"),
        "--data", os.path.join(ASSETS, "tiny_chat.jsonl"), "--draft-config", DRAFTER, "--dtype", "float32",
        "--out", str(tmp_path / "store"), "--num-samples", str(samples), "--max-length", "128", "--no-progress",
    ]) == 0  # fmt: skip
    run = {
        "model": {"target_model_path": "target", "draft_model_config": DRAFTER, "torch_dtype": "float32"},
        "data": {"hidden_states_path": "store", "max_length": 128},
        "training": {"strategy": "dflash2-csbp", "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa",
                     "batch_size": 1, "max_steps": steps, "learning_rate": 0.01, "warmup_ratio": 0.25,
                     "num_anchors": 6, "loss_decay_gamma": 4.0, "log_interval": 1, "seed": 3, "dist_timeout": 2,
                     "save_interval": save_interval},
        "deployment": {"trainer": {"nproc_per_node": 2}},
        "csbp": {"cp_size": 2},
        "run_id": RUN_ID, "output_dir": "out",
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)


def draft_weights(ckpt_dir) -> dict[str, torch.Tensor]:
    state = torch.load(os.path.join(ckpt_dir, "training_state.pt"), map_location="cpu", weights_only=False)
    return state["draft_state_dict"]


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.mark.slow(reason="three SpecForge training launches on 2 gloo ranks")
def test_killed_drafter_run_resumes_bit_identically_and_reshards(tmp_path):
    build_run(tmp_path)
    ref = _ok(specforge_train(["-c", "run.yaml"], tmp_path))
    expected = _losses(ref.stdout)
    assert sorted(expected) == list(range(1, STEPS + 1)), ref.stdout[-2000:]
    assert len(set(expected.values())) == STEPS  # the steps really trained

    killed = specforge_train(["-c", "run.yaml", "output_dir=killed"], tmp_path, fault="kill:1:3")
    assert killed.returncode != 0
    assert sorted(_losses(killed.stdout)) == [1, 2]  # died in step 3, after step 2's checkpoint
    assert os.path.realpath(tmp_path / "killed" / f"{RUN_ID}-latest").endswith(f"{RUN_ID}-step2")

    resumed = _ok(
        specforge_train(["-c", "run.yaml", "output_dir=killed", "training.resume_from=killed"], tmp_path)
    )
    got = _losses(resumed.stdout)
    assert sorted(got) == [3, 4], resumed.stdout[-2000:]
    for step in got:  # float32, bit for bit
        assert got[step] == expected[step], (step, got[step], expected[step])
    final_ref, final = (
        draft_weights(tmp_path / "out" / f"{RUN_ID}-step4"),
        draft_weights(tmp_path / "killed" / f"{RUN_ID}-step4"),
    )
    assert final.keys() == final_ref.keys()
    assert all(torch.equal(final[k], final_ref[k]) for k in final)
    step2 = draft_weights(tmp_path / "out" / f"{RUN_ID}-step2")
    assert any(not torch.equal(step2[k], final_ref[k]) for k in final)  # steps 3-4 moved the weights

    # resharding: the cp=2 checkpoint of step 2 continues as 2 data-parallel replicas (cp_size 1)
    resharded = _ok(specforge_train([
        "-c", "run.yaml", "output_dir=reshard", "csbp.cp_size=1",
        f"training.resume_from={tmp_path / 'out' / f'{RUN_ID}-step2'}",
    ], tmp_path))  # fmt: skip
    assert "csbp over cp_size=1 x dp_replicas=2" in resharded.stdout, resharded.stdout[-2000:]
    got = _losses(resharded.stdout)
    assert sorted(got) == [3, 4]
    for step in got:  # float32: the summation order of the attention merge differs across layouts
        assert abs(got[step] - expected[step]) <= 1e-6 * abs(expected[step]), (
            step,
            got[step],
            expected[step],
        )
    final = draft_weights(tmp_path / "reshard" / f"{RUN_ID}-step4")
    for k in final:
        assert torch.allclose(final[k], final_ref[k], rtol=1e-4, atol=1e-6), k
