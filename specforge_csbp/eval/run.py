"""`evaluate`: every prompt through the speculative loop, the summary JSON and the tau-by-position plot.

Nothing is written until every check has passed (drafter vs target, every prompt's positions); the JSON and
the PNG are written to a temporary file and renamed, so an output is either complete or absent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..outputs import pyplot, save_figure_atomic
from ..preflight import check_finite_tensors
from .choices import DEVICES
from .drafter import DraftContext
from ..progress import progress_bar
from .load import (
    check_pair,
    check_positions,
    load_drafter,
    load_eval_target,
    load_target_config,
    resolve_dtype,
)
from .loop import SequenceResult, speculative_generate
from .metrics import BUCKET_EDGES, summarize
from .target import TargetRunner

__all__ = ["SHAPE_STABLE_BACKENDS", "EvalOptions", "Prepared", "evaluate", "prepare", "plot_tau", "resolve_device", "run_prompts",
           "shape_stable_sdpa", "summary_line"]


@dataclass
class EvalOptions:
    drafter: str
    target: str
    max_new_tokens: int = 64
    device: str = "auto"
    dtype: str = "auto"
    untrained: bool = False
    prefill_chunk: int = 8192
    seed: int = 0
    ignore_eos: bool = False
    progress: bool = True
    bucket_edges: tuple[int, ...] = BUCKET_EDGES


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    return torch.device(name)


def _clock(device: torch.device):
    import time

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def run_prompts(
    drafter,
    target,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    *,
    prefill_chunk: int = 0,
    stop_ids: Sequence[int] = (),
    progress: bool = False,
    proposer_factory=None,
) -> list[SequenceResult]:
    """The loop over `prompts` with a fresh draft context per prompt. `proposer_factory(capacity)` replaces
    the drafter's context (tests: an oracle). Attention runs on shape-stable kernels (shape_stable_sdpa)."""
    device = next(target.parameters()).device
    runner = TargetRunner(target, drafter.target_layer_ids if drafter is not None else [])
    with shape_stable_sdpa():
        return _run_prompts(runner, drafter, target, prompts, max_new_tokens, device=device,
                            prefill_chunk=prefill_chunk, stop_ids=stop_ids, progress=progress,
                            proposer_factory=proposer_factory)  # fmt: skip


#: SDPA backends for eval, cuDNN left out: cuDNN's attention builds an execution graph for every new shape
#: (cached per process), and every verify step has a new key length; a first eval of a process was 3x slower
#: per verify step than a second one over the same lengths (docs/eval.md). Flash, memory-efficient and math
#: kernels take any length without a build.
SHAPE_STABLE_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def shape_stable_sdpa():
    """A context in which scaled_dot_product_attention (the target's and the drafter's) never picks cuDNN."""
    return sdpa_kernel(list(SHAPE_STABLE_BACKENDS))


def _run_prompts(runner, drafter, target, prompts, max_new_tokens, *, device, prefill_chunk, stop_ids, progress,
                 proposer_factory) -> list[SequenceResult]:  # fmt: skip
    results: list[SequenceResult] = []
    bar = progress_bar(total=len(prompts) * max_new_tokens, unit="tok", desc="eval", disable=not progress,
               dynamic_ncols=True)  # fmt: skip
    accepted = steps = 0
    try:
        for prompt in prompts:
            capacity = int(prompt.shape[0]) + max_new_tokens + 2 * int(drafter.block_size if drafter else 1)
            if proposer_factory is not None:
                proposer = proposer_factory(capacity)
            else:
                embed, head = target.get_input_embeddings(), target.get_output_embeddings()
                proposer = DraftContext(drafter, embed, head, capacity)
            result = speculative_generate(
                runner, proposer, prompt, max_new_tokens, prefill_chunk=prefill_chunk, stop_ids=stop_ids,
                on_step=lambda n: bar.update(n), clock=_clock(device),
            )  # fmt: skip
            results.append(result)
            steps += len(result.steps)
            accepted += sum(s.accepted for s in result.steps)
            if steps:
                bar.set_postfix(tau=f"{1 + accepted / steps:.2f}")
            bar.update(max(0, max_new_tokens - len(result.tokens)))  # stopped early: the bar still ends
            runner.cache = None  # the KV cache of a finished prompt is not kept
    finally:
        bar.close()
    return results


@dataclass
class Prepared:
    """What `prepare` checked and loaded: the device, dtype, the target's config and the drafter."""

    device: torch.device
    dtype: str
    target_config: Any
    drafter: Any
    checkpoint: Any


def prepare(options: EvalOptions) -> Prepared:
    """Every check that needs no prompt and no target weight, and the drafter (its weights checked finite):
    run before the prompts are read, so a swapped or mismatched pair is named as such."""
    if options.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {options.max_new_tokens}")
    if options.prefill_chunk < 0:
        raise ValueError(
            f"--prefill-chunk must be >= 0 (0 = the whole prompt at once); got {options.prefill_chunk}"
        )
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    if not options.progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    target_config = load_target_config(options.target)
    drafter, ckpt = load_drafter(options.drafter, untrained=options.untrained, seed=options.seed, dtype=dtype,
                                 device=device)  # fmt: skip
    check_pair(drafter.config, target_config, f"--drafter {options.drafter}", f"--target {options.target}",
               trained_for=None if options.untrained else ckpt.trained_for, target_path=options.target)  # fmt: skip
    return Prepared(device, dtype, target_config, drafter, ckpt)


def evaluate(options: EvalOptions, prompts: Sequence[torch.Tensor], prepared: Prepared | None = None) -> dict[str, Any]:
    """The summary dict (summarize's fields + what was run); `prepared` is `prepare(options)` when the caller
    ran it ahead of reading the prompts."""
    prepared = prepared or prepare(options)
    device, dtype, target_config = prepared.device, prepared.dtype, prepared.target_config
    drafter, ckpt = prepared.drafter, prepared.checkpoint
    S = int(drafter.block_size)
    check_positions(prompts, options.max_new_tokens, S, target_config)
    target = load_eval_target(options.target, dtype=dtype, device=device, seed=options.seed)
    check_finite_tensors(dict(target.named_parameters()), "--target", options.target)
    stop_ids: list[int] = []
    if not options.ignore_eos:
        eos = getattr(target.generation_config, "eos_token_id", None)
        eos = eos if eos is not None else target.config.get_text_config().eos_token_id
        stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results = run_prompts(drafter, target, prompts, options.max_new_tokens, prefill_chunk=options.prefill_chunk,
                          stop_ids=stop_ids, progress=options.progress)  # fmt: skip
    summary = summarize(results, S, options.bucket_edges)
    if summary["verify_steps"] == 0:  # tau of nothing: no result, not a tau of 1
        why = "--max-new-tokens 1 is the target's first token alone" if options.max_new_tokens == 1 else (
            "every prompt ended at its first generated token (the target's EOS; --ignore-eos decodes on)")
        raise ValueError(f"eval: no verify step ran, so there is no tau to report: {why}")
    summary.update(
        drafter=os.path.abspath(options.drafter), drafter_source=ckpt.source, architecture=ckpt.architecture,
        untrained=options.untrained, target=os.path.abspath(options.target), device=str(device), dtype=dtype,
        max_new_tokens=options.max_new_tokens, prefill_chunk=options.prefill_chunk, seed=options.seed,
        stop_ids=stop_ids, loop="greedy speculative decoding as SGLang 0.5.23's DFLASH worker (batch 1)",
        verify_steps_per_s=summary["verify_steps"] / summary["decode_s"] if summary["decode_s"] else None,
        peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )  # fmt: skip
    return summary


def _pos(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def summary_line(summary: dict[str, Any]) -> str:
    tau = "n/a" if summary["tau"] is None else f"{summary['tau']:.2f}"
    parts = [f"tau={tau}", f"verify_steps={summary['verify_steps']}",
             f"generated={summary['generated_tokens']}",
             f"block_size={summary['block_size']}", f"prompts={summary['num_prompts']}"]  # fmt: skip
    for b in summary["buckets"]:
        if b["tau"] is not None:
            end = "+" if b["end"] is None else f"-{_pos(b['end'])}"
            parts.append(f"tau[{_pos(b['start'])}{end}]={b['tau']:.2f}")
    return " ".join(parts)


def _bucket_name(b: dict[str, Any]) -> str:
    return f"{_pos(b['start'])}+" if b["end"] is None else f"{_pos(b['start'])}-{_pos(b['end'])}"


def plot_tau(results_or_summary: dict[str, Any], path: str) -> None:
    """PNG: tau per context-position bucket (bars) and per finer bin of the verify steps (line)."""
    plt = pyplot()
    summary = results_or_summary
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = summary.get("position_bins") or []
    if bins:
        ax.plot([(b["start"] + b["end"]) / 2 for b in bins], [b["tau"] for b in bins], marker="o", ms=3,
                label="tau per position bin")  # fmt: skip
    top = max([summary.get("max_context") or 1] + [b["end"] for b in bins])
    for b in summary["buckets"]:
        if b["tau"] is None:
            continue
        end = b["end"] if b["end"] is not None else top
        first = b is summary["buckets"][0]
        ax.hlines(b["tau"], b["start"], min(end, top), colors="tab:red", linewidth=2,
                  label="tau per bucket (" + ", ".join(_bucket_name(x) for x in summary["buckets"]) + ")"
                  if first else None)  # fmt: skip
        middle = (b["start"] + min(end, top)) / 2
        ax.annotate(f"{b['tau']:.2f} ({b['verify_steps']} steps)", (middle, b["tau"]),
                    textcoords="offset points", xytext=(0, 5), ha="center", fontsize=8)  # fmt: skip
    ax.set_ylim(0.9, summary["block_size"] + 0.1)
    ax.set_xlabel("context position of the draft block")
    ax.set_ylabel("tau (tokens per verify step)")
    tau = summary["tau"] or 0.0
    ax.set_title(f"tau = {tau:.2f} over {summary['verify_steps']} verify steps (S = {summary['block_size']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)
