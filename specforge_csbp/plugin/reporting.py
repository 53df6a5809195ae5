"""What a `specforge train --csbp` run shows and reports: a progress bar instead of dict dumps, and the
acceptance estimate and per-slot accuracy of SpecForge's eval passes.

    launcher: run = build_application_run(...); lookahead.install(run); reporting.install(run); run.run()

    TrainerController (SpecForge 0.2.0)          after install
      _make_progress_bar() -> tqdm if a tty      -> on rank 0 of a terminal, one tqdm bar with the run's numbers
                                                    instead of a dict per step:
                                                    Training  40%|####      | 40/100 [loss=2.31, acc=0.412,
                                                    est_tau=1.83, tok/s=5.1e+04]   + `eval step N: ...` lines
      logger(metrics, step)                      -> every metric still goes to SpecForge's tracker (TrackerLogger
        print(f"step {step}: {dict}")               .tracker, unchanged); without a terminal (log file, pipe, CI)
                                                    the console line stays SpecForge's `step N: {...}` (tools
                                                    parse it: benchmarks, tests); rank 0 appends
                                                    {"step": N, metric: value, ...} to <output_dir>/metrics.jsonl
      evaluate(data) -> Evaluator().run(...)     -> the same, then `eval/est_tau` and `eval/slot_acc_k` from the
                                                    strategy's eval sums (one all-reduce over the world)

A drafter that does not learn is said so: the first logged step at or after `csbp.plateau_steps` whose
training est_tau is below PLATEAU_TAU prints one line (PlateauCheck) with the likely cause and the recipe
(docs/long_context.md) - on rank 0, whatever the console.

tokens/s = `tokens_per_micro_step` (a ratio metric: global tokens per micro-step, exact) x the accumulation
steps / SpecForge's `perf/optimizer_step_time_s` of the log window. Nothing here runs per micro-step: the bar
moves once per optimizer step (SpecForge's own `progress.update`), its fields once per `training.log_interval`.
A SpecForge whose controller keeps none of these attributes is left as it is (install returns False).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..progress import interactive, progress_bar

__all__ = ["LONG_FROM_SCRATCH", "METRICS_FILE", "PLATEAU_TAU", "PlateauCheck", "ProgressConsole", "install"]

METRICS_FILE = "metrics.jsonl"
#: est_tau below this after csbp.plateau_steps: the drafter proposes next to no right token (1.0: none)
PLATEAU_TAU = 1.1
#: a from-scratch run longer than this is the long-context case of PlateauCheck's message (the study's
#: drafters learn at 4K windows and stay on the plateau from scratch at 64K: docs/long_context.md)
LONG_FROM_SCRATCH = 8192
#: what the bar shows, in order: (metric name, label, format)
_FIELDS = (("loss", "loss", ".4g"), ("acc", "acc", ".3f"), ("est_tau", "est_tau", ".3f"))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _plain(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Scalar floats under their plain names (`train/loss` -> `loss`; eval keys keep `eval/`)."""
    out = {}
    for key, value in metrics.items():
        name = key[len("train/") :] if key.startswith("train/") else key
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class PlateauCheck:
    """One look at est_tau, at the first logged step >= `steps` (0: never): below PLATEAU_TAU, `message` is
    the line to print (None otherwise, and at every later step). `max_length`, `warm_start`: the run's
    data.max_length and model.draft_checkpoint_path; `full_attention`: whether a drafter layer is full
    attention. Together they decide the likely cause and the recipe named."""

    def __init__(
        self, steps: int, max_length: int | None = None, warm_start: str | None = None,
        full_attention: bool | None = None,
    ) -> None:  # fmt: skip
        self.steps, self.max_length, self.warm_start = steps, max_length, warm_start
        self.full_attention = full_attention  # the drafter has a full-attention layer (None: not known)
        self.done = steps <= 0

    def __call__(self, values: Mapping[str, float], step: int) -> str | None:
        tau = values.get("est_tau")
        if self.done or tau is None or step < self.steps:
            return None
        self.done = True
        if tau >= PLATEAU_TAU:
            return None
        head = (f"specforge-csbp: est_tau {tau:.3f} after {step} steps (csbp.plateau_steps={self.steps}): the "
                "drafter is still on the unigram plateau (next to no drafted token would be accepted); ")  # fmt: skip
        two_stage = ("train at 4K-8K tokens first, then continue at this length from those weights "
                     "(model.draft_checkpoint_path, fresh optimizer, a short warm-up; docs/long_context.md)")  # fmt: skip
        long_from_scratch = self.warm_start is None and (self.max_length or 0) > LONG_FROM_SCRATCH
        if long_from_scratch and self.full_attention is not False:
            return head + (
                f"likely cause: trained from scratch at data.max_length={self.max_length} with full-attention "
                "layers, whose fresh attention spreads over the whole context so the nearby features that carry "
                "the next tokens get little of it; recipe: sliding-window layers (layer_types sliding_attention, "
                "sliding_window 2048, as drafter_configs/qwen3.6-27b-dflash2.json), or " + two_stage
            )  # fmt: skip
        if long_from_scratch:
            return head + (
                f"likely cause: too few steps or a learning rate that does not fit for a drafter trained from "
                f"scratch at data.max_length={self.max_length} (training.learning_rate, training.warmup_ratio); "
                "recipe: " + two_stage
            )  # fmt: skip
        return head + (
            "likely cause: too few steps or a learning rate that does not fit (training.learning_rate, "
            "training.warmup_ratio), or target features that do not predict the text (check the store's "
            "target and target_layer_ids); recipe: docs/long_context.md"
        )  # fmt: skip


class ProgressConsole:
    """The console side of SpecForge's `logger(metrics, step)` seam on one rank. On rank 0 of a terminal: a
    tqdm bar whose fields show loss / acc / est_tau / tok/s, and one `eval step N: ...` line per eval pass.
    Anywhere else (a log file, a pipe, CI, other ranks): `fallback`, SpecForge's own console line (`step N:
    {...}`), unchanged - logs keep every number in the format tools already parse. Rank 0 also appends every
    logged metric to `<output_dir>/metrics.jsonl`. `accumulation_steps` turns tokens per micro-step into
    tokens per optimizer step."""

    def __init__(
        self, output_dir: str | None, accumulation_steps: int = 1, total: int | None = None, fallback=None,
        plateau: PlateauCheck | None = None,
    ) -> None:
        self.rank0 = _rank() == 0
        self.plateau = plateau if plateau is not None and self.rank0 else None
        self.accumulation_steps = max(1, int(accumulation_steps))
        self.total, self.fallback = total, fallback
        self.bar = None
        self.path = os.path.join(output_dir, METRICS_FILE) if output_dir and self.rank0 else None

    def make_bar(self, initial: int = 0):
        """The run's progress bar on rank 0 of an interactive terminal, else None (SpecForge calls
        `update(1)` per optimizer step and closes it)."""
        if not (self.rank0 and interactive(sys.stderr)):
            self.bar = None
            return None
        self.bar = progress_bar(
            total=self.total, initial=initial, desc="Training", unit="step", mininterval=1.0,
            dynamic_ncols=True, file=sys.stderr,
        )  # fmt: skip
        return self.bar

    def fields(self, values: Mapping[str, float]) -> dict[str, str]:
        """The bar's postfix for one logged step."""
        shown = {label: format(values[name], fmt) for name, label, fmt in _FIELDS if name in values}
        per_step = values.get("perf/optimizer_step_time_s")
        tokens = values.get("tokens_per_micro_step")
        if per_step and tokens is not None and per_step > 0:
            shown["tok/s"] = f"{tokens * self.accumulation_steps / per_step:.3g}"
        return shown

    def __call__(self, metrics: Mapping[str, Any], step: int) -> None:
        values = _plain(metrics)
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            clean = {k: v for k, v in values.items() if math.isfinite(v)}
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": int(step), **clean}, sort_keys=True) + "\n")
        warning = self.plateau(values, step) if self.plateau is not None else None
        if warning is not None:
            if self.bar is not None:
                self.bar.write(warning, file=sys.stderr)
            else:
                print(warning, file=sys.stderr, flush=True)
        if self.bar is None:
            if self.fallback is not None:
                self.fallback(metrics, step)
            return
        if any(k.startswith("eval/") for k in values):
            parts = [  # per-slot accuracy: tracker and metrics.jsonl only; SpecForge's simulated_acc_len is
                # avg_acc again for a scalar-accuracy strategy (its Evaluator): est_tau is the estimate here
                f"{k[len('eval/'):]}={v:.4g}" for k, v in values.items()
                if k.startswith("eval/") and not k.startswith(("eval/slot_acc_", "eval/simulated_acc_len"))
            ]  # fmt: skip
            self.bar.write(f"eval step {step}: " + " ".join(parts), file=sys.stderr)
            return
        self.bar.set_postfix(self.fields(values), refresh=False)


def _with_eval_extras(controller, strategy):
    """controller.evaluate, plus the strategy's est_tau / per-slot accuracy of the same pass."""
    evaluate = controller.evaluate

    def evaluate_with_extras(data):
        strategy.reset_eval()
        metrics = evaluate(data)
        backend = str(dist.get_backend()).lower() if dist.is_initialized() else ""
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        extras = strategy.eval_extras(device)  # collective: every rank, whatever the pass returned
        return {**metrics, **extras} if metrics else metrics

    return evaluate_with_extras


def install(run: Any, output_dir: str | None = None, plateau: PlateauCheck | None = None) -> bool:
    """Hook the progress bar, the console (with `plateau`'s check) and the eval extras into SpecForge's
    `TrainingRun` (before `run.run()`); False, changing nothing, when its trainer does not keep a controller
    where 0.2.0 does."""
    trainer = getattr(run, "trainer", None)
    controller = getattr(trainer, "_controller", None)
    core = getattr(controller, "core", None)
    strategy = getattr(core, "strategy", None)
    if controller is None or not hasattr(controller, "logger") or not hasattr(controller, "_make_progress_bar"):
        return False
    total = controller.max_steps if controller.max_steps is not None else controller.total_steps
    logger = controller.logger
    tracked = logger is not None and hasattr(logger, "console_logger")  # SpecForge's TrackerLogger
    console = ProgressConsole(
        output_dir or getattr(controller, "output_dir", None), getattr(core, "accumulation_steps", 1), total,
        fallback=logger.console_logger if tracked else logger, plateau=plateau,
    )  # fmt: skip
    if tracked:  # the tracker itself is untouched: it still receives every metric
        logger.console_logger = console
    else:  # the console-only logger (tracking.report_to: none)
        controller.logger = console
    controller._make_progress_bar = lambda: console.make_bar(controller.global_step)
    if strategy is not None and hasattr(strategy, "eval_extras"):
        controller.evaluate = _with_eval_extras(controller, strategy)
    return True
