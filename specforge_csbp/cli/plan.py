"""`specforge-csbp plan`: which DP x CP x mode layout fits a model and context, and how fast it will run.

    specforge-csbp plan --model config.json --context 512K --gpus 8 --gpu-mem 141 [--workload drafter]
    specforge-csbp plan --calibrate --profile-out h200x2.json            # CPU: spawns gloo ranks
    torchrun --nproc-per-node 2 -m specforge_csbp plan --calibrate --profile-out h200x2.json
    torchrun --nproc-per-node 2 -m specforge_csbp plan --calibrate --model qwen3-1.7b.json --workload sft \
        --profile-out h200x2.json        # + the rate of this model's own decoder layer (BDLM workloads)

Prints every layout's predicted step time, tokens/s and peak memory, the recommended layout, and the
predicted scaling to 8 and 16 GPUs at 512K and 1M next to the calibration it comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict

from ..bench.grid import parse_size
from ..planner.cost import WORKLOADS, Options, Prediction, bdlm_layer
from ..planner.profile import BUILTIN_PROFILES, MachineProfile, calibrate, load_profile
from ..planner.search import plan_layouts, scaling_table
from ..planner.shapes import ModelShape, load_shape

__all__ = ["format_plan", "register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict step time / memory of every parallel layout and recommend one",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", help="config.json of the model (HF causal LM) or of a DFlash drafter")
    p.add_argument("--context", default="128K", help="clean context length (tokens; 64K, 1M, ...)")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--gpu-mem", type=float, default=141.0, help="GiB per GPU")
    p.add_argument("--workload", choices=WORKLOADS, default=None, help="default: drafter for drafter configs, else sft")
    p.add_argument("--profile", default="h200-nominal",
                   help=f"machine profile JSON or built-in ({', '.join(BUILTIN_PROFILES)})")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's profile first; with --model of an sft / convert workload "
                        "also that model's decoder-layer rate (fp32 weights, bf16 autocast, --checkpointing)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks for --calibrate on CPU")
    p.add_argument("--profile-out", default=None, help="write the calibrated profile here")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--anchors", type=int, default=512, help="drafter: draft blocks per sequence")
    p.add_argument("--checkpointing", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--keep-logits-gib", type=float, default=0.0,
                   help="drafter: keep the loss's logits for backward when they fit in this many GiB")
    p.add_argument("--state-bytes", type=float, default=16.0, help="bytes per trainable parameter (weights+grads+Adam)")
    p.add_argument("--no-scaling", action="store_true", help="skip the 8/16-GPU prediction at 512K and 1M")
    p.add_argument("--json", default=None, help="also write the predictions as JSON here")
    p.set_defaults(func=run)


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "—" if x is None else format(x, spec)


def _ctx(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def format_plan(shape: ModelShape, workload: str, context: int, gpus: int, gpu_mem: float,
                profile: MachineProfile, options: Options, preds: list[Prediction], rec: Prediction | None,
                scaling) -> str:  # fmt: skip
    lines = [
        f"plan: {shape.name} ({shape.layers} layers, hidden {shape.hidden}, heads {shape.heads}/{shape.kv_heads}, "
        f"head dim {shape.head_dim}, vocab {shape.vocab}), workload {workload}, context {_ctx(context)} "
        f"(block {options.block_size}" + (f", {options.anchors} anchors" if workload == "drafter" else "")
        + f"), {gpus} GPU(s) x {gpu_mem:g} GiB",
        f"calibration: {profile.summary()}",
        *_layer_rate_line(shape, workload, profile, options),
        "",
        f"{'layout':<16} {'step ms':>10} {'tokens/s':>12} {'peak GiB':>9}  {'fits':<4}  "
        "gemm / attention / loss / exposed comm ms",
    ]
    for p in preds:
        if p.step_ms is None:
            lines.append(f"{p.layout.label:<16} {'—':>10} {'—':>12} {'—':>9}  {'no':<4}  {p.reason}")
            continue
        b = p.breakdown_ms
        parts = " / ".join(f"{b[k]:.1f}" for k in ("gemm", "attention", "loss", "exposed_comm"))
        if b.get("optimizer"):  # only with a profile that measured the AdamW rate
            parts += f" (+ optimizer {b['optimizer']:.1f})"
        mark = "<- recommended" if rec is not None and p.layout == rec.layout else (p.reason if not p.fits else "")
        lines.append(f"{p.layout.label:<16} {p.step_ms:>10.1f} {p.tokens_per_s:>12,.0f} {p.peak_gib:>9.2f}  "
                     f"{'yes' if p.fits else 'no':<4}  {parts}  {mark}".rstrip())  # fmt: skip
    lines.append("")
    if rec is None:
        lines.append("recommended: none - no layout fits; use more GPUs, a shorter context or fewer anchors")
    else:
        lines.append(f"recommended: {rec.layout.label} - {rec.tokens_per_s:,.0f} tokens/s, {rec.peak_gib:.2f} GiB "
                     "peak (fastest that fits; within 1%: less memory, then more DP)")  # fmt: skip
    if scaling:
        lines += ["", f"predicted scaling (same model/workload; calibration: {profile.summary()})",
                  f"{'gpus':>4} {'context':>7}  {'best CSBP':<16} {'tokens/s':>12}  {'best other':<16} "
                  f"{'tokens/s':>12}  {'CSBP/other':>10}  {'vs 1 GPU':>8}"]  # fmt: skip
        for r in scaling:
            c, o = r.csbp, r.other
            lines.append(
                f"{r.gpus:>4} {_ctx(r.context):>7}  {(c.layout.label if c else 'none fits'):<16} "
                f"{_fmt(c.tokens_per_s if c else None):>12}  {(o.layout.label if o else 'none fits'):<16} "
                f"{_fmt(o.tokens_per_s if o else None):>12}  {_fmt(r.speedup_over_other, '.2f'):>10}  "
                f"{(_fmt(r.speedup_over_single, '.2f') if r.single else '1 GPU oom'):>8}"
            )
    return "\n".join(lines)


def _layer_rate_line(
    shape: ModelShape, workload: str, profile: MachineProfile, options: Options
) -> list[str]:
    """Which rate a BDLM's token-wise work is charged at - only for profiles that measured a BDLM layer
    (older profiles print what they always printed)."""
    if workload == "drafter" or profile.bdlm_layer_tflops is None:
        return []
    key = bdlm_layer(shape, options).key
    if profile.bdlm_layer_shape == key:
        rate = profile.bdlm_layer_tflops
        return [f"decoder layers: {rate:.3g} TFLOP/s, measured at this model's layer ({key})"]
    return [(f"decoder layers: {profile.token_tflops:.3g} TFLOP/s (layer_tflops): the profile's BDLM layer "
             f"is {profile.bdlm_layer_shape}, this plan's {key}; calibrate with --model to measure it")]


def _pred_json(p: Prediction | None) -> dict | None:
    if p is None:
        return None
    return {
        "layout": p.layout.label, "dp": p.layout.dp, "cp": p.layout.cp, "mode": p.layout.mode,
        "step_ms": p.step_ms, "tokens_per_s": p.tokens_per_s, "peak_gib": p.peak_gib, "fits": p.fits,
        "reason": p.reason, "breakdown_ms": p.breakdown_ms, "memory_gib": asdict(p.memory) if p.memory else None,
    }  # fmt: skip


def _check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag before anything is loaded or measured (argparse lets 0, -1, nan and inf in)."""
    import math

    for flag, value, low, strict in (
        ("block_size (--block-size)", args.block_size, 1, False), ("anchors (--anchors)", args.anchors, 1, False),
        ("gpus (--gpus)", args.gpus, 1, False), ("world_size (--world-size)", args.world_size, 1, False),
        ("gpu_mem (--gpu-mem)", args.gpu_mem, 0, True), ("state_bytes (--state-bytes)", args.state_bytes, 0, True),
        ("keep_logits_gib (--keep-logits-gib)", args.keep_logits_gib, 0, False),
    ):  # fmt: skip
        if not math.isfinite(value) or value < low or (strict and value == low):
            bound = f"> {low}" if strict else f">= {low}"
            raise ValueError(f"{flag} must be a finite number {bound}, got {value}")


def run(args: argparse.Namespace) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    is_rank0 = not under_torchrun or os.environ.get("RANK") == "0"
    _check_numbers(args)
    shape = workload = None
    if args.model is not None:  # before calibrating: a bad config fails in a second, not after the run
        shape = load_shape(args.model)
        workload = args.workload or ("drafter" if shape.drafter else "sft")
        load_shape(args.model, workload=workload)  # one-line error when workload and config disagree
    options = Options(block_size=args.block_size, anchors=args.anchors, state_bytes_per_param=args.state_bytes,
                      keep_logits_gib=args.keep_logits_gib,
                      checkpointing={"auto": None, "on": True, "off": False}[args.checkpointing])  # fmt: skip
    if args.calibrate:
        layer = bdlm_layer(shape, options) if shape is not None and workload != "drafter" else None
        command = shlex.join(["specforge-csbp", *sys.argv[1:]])
        profile = calibrate(args.world_size, command=command, bdlm_layer=layer)
        if under_torchrun:
            import torch.distributed as dist

            dist.destroy_process_group()
        if not is_rank0:
            return 0
        print(f"calibrated: {profile.summary()}")
        if args.profile_out:
            os.makedirs(os.path.dirname(os.path.abspath(args.profile_out)), exist_ok=True)
            with open(args.profile_out, "w") as f:
                f.write(profile.model_dump_json(indent=2) + "\n")
            print(f"profile written to {args.profile_out}")
    else:
        profile = load_profile(args.profile)
    if shape is None:
        if args.calibrate:
            return 0
        raise ValueError("model: give --model CONFIG (or --calibrate alone to only measure)")
    context = parse_size(args.context, field="--context")
    if args.gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {args.gpus}")
    if args.gpu_mem <= 0:
        raise ValueError(f"gpu_mem must be > 0 GiB, got {args.gpu_mem}")
    result = plan_layouts(shape, workload, context, args.gpus, args.gpu_mem, profile, options)
    scaling = [] if args.no_scaling else scaling_table(shape, workload, args.gpu_mem, profile, options)
    print(format_plan(shape, workload, context, args.gpus, args.gpu_mem, profile, options, result.predictions,
                      result.recommended, scaling))  # fmt: skip
    if args.json:
        data = {
            "model": args.model, "workload": workload, "context": context, "gpus": args.gpus,
            "gpu_mem_gib": args.gpu_mem, "options": asdict(options), "profile": profile.model_dump(),
            "predictions": [_pred_json(p) for p in result.predictions],
            "recommended": _pred_json(result.recommended),
            "scaling": [{"gpus": r.gpus, "context": r.context, "csbp": _pred_json(r.csbp), "other": _pred_json(r.other),
                         "speedup_over_other": r.speedup_over_other, "speedup_over_single": r.speedup_over_single}
                        for r in scaling],
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
    return 0
