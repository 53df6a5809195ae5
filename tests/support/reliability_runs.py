"""Shared pieces of the reliability tests (no tests here): the tiny BDLM recipe, a workload wrapper that
injects faults, and helpers to read runs back.

`Wrapped` is the real BDLM workload plus:
  - float64 RMSNorms (`tiny.float64_norms`), so different partitions agree to float64 rounding;
  - optionally a draw from the global torch RNG in every loss (so a resume that did not restore the RNG
    would diverge);
  - an optional fault {kind, rank, step}: kill (SIGKILL in the forward), hang (sleep in the forward),
    nan_loss, inf_grad (one gradient element set to +inf by a one-shot hook), kill_save (SIGKILL after the
    model files of checkpoint `step` are written, before the optimizer state and the manifest).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.support.checks import rel_err

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SFT = str(EXAMPLES / "bdlm_sft_tiny.yaml")
BASE = [
    "train.precision=float64", "train.progress=false", "train.lr=1e-2", "train.warmup_steps=1",
    "train.save_every=1", "train.keep_checkpoints=8", "data.max_length=40",
]  # fmt: skip
GRAD_PARAM = "lm.model.layers.1.mlp.up_proj.weight"


class Wrapped:
    def __init__(
        self, inner, *, fault: dict | None = None, jitter: bool = False, record_load: str | None = None
    ):
        self.inner, self.fault, self.jitter, self.record_load = inner, fault or {}, jitter, record_load
        self.rank, self.step = 0, -1

    def _hit(self, kind: str, step: int | None = None) -> bool:
        f = self.fault
        return (
            f.get("kind") == kind
            and f["rank"] == self.rank
            and f["step"] == (self.step if step is None else step)
        )

    def build_model(self, ctx):
        from specforge_csbp.models.bdlm.tiny import float64_norms

        self.rank = ctx.rank
        model = self.inner.build_model(ctx)
        float64_norms(model.lm)
        return model

    def microbatches(self, ctx, step):
        self.step = step
        return self.inner.microbatches(ctx, step)

    def loss_numerator(self, model, batch, ctx=None):
        if self._hit("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._hit("hang"):
            time.sleep(3600)
        if self._hit("inf_grad"):
            param = dict(model.named_parameters())[GRAD_PARAM]

            def poison(grad):
                handle.remove()
                grad = grad.clone()
                grad.view(-1)[3] = float("inf")
                return grad

            handle = param.register_hook(poison)
        numerator = self.inner.loss_numerator(model, batch, ctx)
        if self.jitter:  # consumes the global RNG: a resume must restore it to repeat this draw
            numerator = numerator * (1 + 1e-3 * torch.rand((), dtype=numerator.dtype))
        if self._hit("nan_loss"):
            numerator = numerator * float("nan")
        return numerator

    def tokens_per_step(self, ctx):
        return self.inner.tokens_per_step(ctx)

    def flops_per_step(self, ctx):
        return self.inner.flops_per_step(ctx)

    def save_model(self, model, path):
        self.inner.save_model(model, path)
        if self._hit("kill_save", step=int(Path(path).name.split("_")[1].split(".")[0])):
            os.kill(os.getpid(), signal.SIGKILL)

    def load_model(self, model, path):
        self.inner.load_model(model, path)
        if self.record_load and self.rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.lm.state_dict().items()}, self.record_load)


def run_recipe(overrides: list[str], **wrap) -> list[dict]:
    """Build the tiny SFT recipe with `overrides`, wrap it, and train on the current process group."""
    from specforge_csbp.models.bdlm.recipe import BDLMRecipe, build_workload
    from specforge_csbp.training.config import load_recipe
    from specforge_csbp.training.trainer import train

    recipe = load_recipe(BDLMRecipe, SFT, BASE + overrides)
    return train(Wrapped(build_workload(recipe), **wrap), recipe.train, recipe.parallel)


def seed_resume(src: Path, step: int, dst: Path) -> None:
    """A fresh output_dir whose only checkpoint is a copy of `src`'s step `step` (what a new job resumes)."""
    import shutil

    name = f"step_{step:08d}"
    dst.mkdir(parents=True)
    shutil.copytree(src / name, dst / name)
    (dst / "latest").write_text(name)


def log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def weights(run: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    name = (run / "latest").read_text() if step is None else f"step_{step:08d}"
    return load_file(str(run / name / "model.safetensors"))


def max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(rel_err(a[k], b[k]) for k in a)


def all_gone(pids, within: float = 5.0) -> bool:
    """True once none of `pids` runs; SIGKILL lands asynchronously, so allow a short grace under load."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie - dead, not yet reaped by its new parent - counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False
