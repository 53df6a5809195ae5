#!/usr/bin/env python
"""BDLM SFT training benchmark: CSBP vs CP vs BP vs DP (and one GPU), Qwen3-1.7B shapes, random weights.

    GPU (2 x H200):  torchrun --standalone --nproc-per-node 2 benchmarks/bdlm_bench.py \
                         --contexts 65536 131072 --out benchmarks/results/bdlm_sft_h200x2.jsonl
    CPU smoke:       python benchmarks/bdlm_bench.py --smoke --out /tmp/bdlm_smoke.jsonl

Every point (mode, context) runs the trainer's own `train_step` (global denominator, micro-batch backward,
summed gradients, clipping, fused AdamW) with bf16 autocast and activation checkpointing: `--warmup`
untimed steps (compilation, block masks), then `--steps` timed ones. One sequence of `context` clean
tokens per step for csbp / cp / bp (its 2L rows spread over the ranks), one sequence per rank for dp,
one sequence on rank 0 alone for `reference` (the 1-GPU baseline of the scaling efficiency).

Per-step breakdown (ms, rank 0), from CUDA events placed by autograd identity functions around every
attention call, every MLP and the loss (forward, activation-checkpoint recompute and backward):

    attention_ms      attention compute (from a control step without collectives when the mode has any)
    mlp_ms            the decoder MLPs
    loss_ms           the chunked linear cross-entropy (LM head) on the supervised rows
    exposed_comm_ms   attention time the collectives add (step with comm - control step) + gradient
                      all-reduce (fully exposed: it runs after the backward)
    other_ms          the rest: projections, norms, RoPE, embeddings, optimizer, data

Records (design.md section 8) are appended to --out after every point, so a later crash keeps earlier
points. A point that runs out of memory on any rank is recorded with status "oom".

Imports pydantic only to write records (specforge_csbp.bench.records); without pydantic the same JSON
lines are written directly.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import sys
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from nocomm import no_attention_communication

from specforge_csbp.bench.isolation import fresh_point
from specforge_csbp.values import size_arg
from specforge_csbp.bench.provenance import library_digest
from specforge_csbp.distributed.collectives import COMM_STATS
from specforge_csbp.distributed.launch import init_from_env, spawn
from specforge_csbp.layout.plans import check_bdlm_shape
from specforge_csbp.models.bdlm import BDLMModel, BDLMWorkload
from specforge_csbp.models.bdlm.data import SyntheticSource
from specforge_csbp.models.bdlm.tiny import QWEN3_1_7B, TINY_CONFIGS
from specforge_csbp.objectives.convert import ConvertObjective
from specforge_csbp.objectives.sft import SFTObjective
from specforge_csbp.training.context import TrainContext
from specforge_csbp.training.metrics import peak_device_tflops, peak_memory_gib
from specforge_csbp.training.step import StepOutOfMemory, train_step

MODES = ("reference", "csbp", "cp", "bp", "dp")
CATEGORIES = ("attention", "mlp", "loss", "grad_reduce")


# -- timing ---------------------------------------------------------------------------------------------
class SpanTimer:
    """Accumulates (begin, end) spans per name: CUDA events on GPU (read after a sync), wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.open: dict[str, list] = defaultdict(list)
        self.spans: dict[str, list] = defaultdict(list)

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self, name: str, begin: bool) -> None:
        if begin:
            self.open[name].append(self._now())
        else:
            self.spans[name].append((self.open[name].pop(), self._now()))

    @contextmanager
    def span(self, name: str):
        self.mark(name, True)
        yield
        self.mark(name, False)

    def total_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(a.elapsed_time(b) for a, b in v) for k, v in self.spans.items()}
        return {k: 1e3 * sum(b - a for a, b in v) for k, v in self.spans.items()}

    def edge(self, name: str, begin: bool, *tensors: torch.Tensor):
        """Identity on `tensors` that marks `name` in forward and the mirrored edge in backward."""
        out = _Edge.apply(self, name, begin, *tensors)
        return out if len(tensors) > 1 else out[0]


class _Edge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer, name, begin, *tensors):
        ctx.timer, ctx.name, ctx.begin = timer, name, begin
        timer.mark(name, begin)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.timer.mark(ctx.name, not ctx.begin)  # backward walks the span from its end to its begin
        return (None, None, None, *grads)


class TimedAttention:
    """The rank's ShardedAttention with an 'attention' span around every call."""

    def __init__(self, inner, timer: SpanTimer):
        self.inner, self.timer, self.plan = inner, timer, inner.plan
        self.block_size = inner.block_size

    def windowed(self, window: int) -> "TimedAttention":
        """Sliding-window layers: the inner executor's windowed sibling, timed the same way (cached)."""
        cache = self.__dict__.setdefault("_windowed", {})
        if window not in cache:
            cache[window] = TimedAttention(self.inner.windowed(window), self.timer)
        return cache[window]

    def __call__(self, q, k, v, *, scale=None):
        q, k, v = self.timer.edge("attention", True, q, k, v)
        out, lse = self.inner(q, k, v, scale=scale)
        return self.timer.edge("attention", False, out), lse


def instrument_mlps(model: BDLMModel, timer: SpanTimer) -> int:
    """An 'mlp' span around every decoder layer's MLP (instance-level wrapper, model code untouched)."""
    count = 0
    for layer in model.lm.base_model.layers:
        mlp = layer.mlp
        inner = mlp.forward

        def forward(x, _inner=inner):
            return timer.edge("mlp", False, _inner(timer.edge("mlp", True, x)))

        mlp.forward = forward
        count += 1
    return count


class TimedWorkload(BDLMWorkload):
    def __init__(self, timer: SpanTimer, **kw):
        super().__init__(**kw)
        self.timer = timer

    def loss_numerator(self, model, batch, ctx=None):
        hidden, router = model.forward_with_router_logits(
            batch.batch.input_ids, self._attention, router_logits=self.aux_coef > 0
        )
        hidden = self.timer.edge("loss", True, hidden)
        weight, bias = model.head()
        num = batch.batch.loss_numerator(hidden, weight, bias, exclude_ids=self.exclude_ids,
                                         chunk_size=self.ce_chunk_size)  # fmt: skip
        num = num + self.aux_numerator(model, batch, router).to(num.dtype)  # MoE: the router's aux loss
        return self.timer.edge("loss", False, num)


# -- records -----------------------------------------------------------------------------------------------
def write(path: str, record: dict) -> None:
    try:
        from specforge_csbp.bench.records import BenchRecord, write_records
    except ImportError:  # benchmark machines without pydantic: the same JSON line, unvalidated
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
        return
    write_records(path, [BenchRecord(**record)])


# -- one point -------------------------------------------------------------------------------------------
def _layout(mode: str, rank: int, world: int, single):
    """(participants, step group, cp group, plan mode, dp, cp)."""
    if mode == "reference":
        return [0], single, None, "reference", 1, 1
    if mode == "dp":
        return list(range(world)), None, None, "reference", world, 1
    return list(range(world)), None, dist.group.WORLD, mode, 1, world


def _max(value: float, group, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def command_line(world: int) -> str:
    """The command that started this run: torchrun (NCCL ranks) or python (self-spawned gloo ranks)."""
    argv = [os.path.relpath(sys.argv[0])] + sys.argv[1:]
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={world}", *argv])
    return shlex.join(["python", *argv])


def run_point(
    args, model, optimizer, timer, single, mode: str, seq_len: int, device, ref_tps: dict
) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    participants, group, cp_group, plan_mode, dp, cp = _layout(mode, rank, world, single)
    command = command_line(world)
    record = dict(
        workload=args.objective,
        mode=mode,
        world_size=len(participants),
        context_len=seq_len,
        block_size=args.block_size,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        date=datetime.date.today().isoformat(),
        code=library_digest(),  # which library code ran (bench/provenance.py)
        command=command,
        launch=command,  # records of one launch are compared side by side (bench/compare.py)
        model=args.model_name,
        precision="bf16-autocast" if args.autocast else "float32",
        activation_checkpointing=args.checkpointing,
        steps=args.steps,
        warmup=args.warmup,
        schedule=args.schedule,
        fresh_compile=True,  # fresh_point() before every mode
        status="ok",
    )
    if rank not in participants:
        return None
    try:
        check_bdlm_shape(plan_mode, seq_len, args.block_size, cp)
    except ValueError as err:
        return dict(record, status="error", error=str(err))
    ctx = TrainContext(
        rank=rank,
        world_size=len(participants),
        dp_rank=rank if dp > 1 else 0,
        dp_size=dp,
        cp_rank=rank if cp > 1 else 0,
        cp_size=cp,
        mode=plan_mode,
        mesh=None,
        cp_group=cp_group,
        dp_group=None,
        device=device,
        param_dtype=torch.float32,
        autocast_dtype=torch.bfloat16 if args.autocast else None,
        attention_backend=args.backend,
        attention_schedule=args.schedule,
        seed=args.seed,
        micro_batch_size=1,
        grad_accum=1,
    )
    vocab = model.vocab_size
    workload = TimedWorkload(
        timer, make_model=lambda: model, objective=OBJECTIVES[args.objective](args.block_size, vocab - 1, vocab),
        source=SyntheticSource(vocab_size=vocab, seq_len=seq_len, reserved=(vocab - 1,), seed=args.seed),
        seq_len=seq_len, exclude_mask_from_softmax=True, ce_chunk_size=args.ce_chunk_size,
    )  # fmt: skip
    attention = model.attention(plan_mode, seq_len, cp_group)
    workload.bind(model, ctx, TimedAttention(attention, timer))
    record["rows_per_rank"] = int(_max(float(len(attention.plan.q_rows)), group, device))
    step_no = 0

    def steps(n: int) -> list[float]:
        nonlocal step_no
        out = []
        for _ in range(n):
            _sync(device)
            t0 = time.perf_counter()
            result = train_step(
                model, optimizer, workload, ctx, step_no, grad_clip=1.0, group=group, span=timer.span
            )
            _sync(device)
            out.append((time.perf_counter() - t0, result.denominator))
            step_no += 1
        return out

    try:
        steps(args.warmup)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timer.reset()
        COMM_STATS.reset()
        timed = steps(args.steps)
        spans = {k: v / args.steps for k, v in timer.total_ms().items()}
        comm_bytes = COMM_STATS.total / args.steps
        peak = peak_memory_gib(device)  # GPU: peak allocated; CPU: peak resident set of the process
        step_s = _max(sum(t for t, _ in timed) / len(timed), group, device)
        tokens = timed[0][1]  # global denominator = supervised (eligible) tokens of the step, whole job
        record.update(
            step_ms=1e3 * step_s,
            tokens_per_s=tokens / step_s,
            peak_mem_gib=_max(peak, group, device),
            attn_comm_gib_per_step=comm_bytes / 2**30,
        )
        record["tokens_per_s_per_gpu"] = record["tokens_per_s"] / len(participants)
        flops = workload.flops_per_step(ctx)
        peak_tflops = peak_device_tflops(device, args.peak_tflops)
        if peak_tflops:
            record["mfu"] = flops / step_s / (len(participants) * peak_tflops * 1e12)
        attention_ms = spans.get("attention", 0.0)
        record["attention_with_comm_ms"] = attention_ms
        if mode in args.breakdown_modes and attention.plan.communicates:
            # the control: the same executor with its collectives replaced by local copies (benchmarks/nocomm.py)
            with no_attention_communication():
                steps(1)
                timer.reset()
                steps(1)
            attention_ms = timer.total_ms().get("attention", 0.0)
        exposed = max(record["attention_with_comm_ms"] - attention_ms, 0.0) + spans.get("grad_reduce", 0.0)
        record.update(
            attention_ms=attention_ms, mlp_ms=spans.get("mlp", 0.0), loss_ms=spans.get("loss", 0.0),
            grad_reduce_ms=spans.get("grad_reduce", 0.0), exposed_comm_ms=exposed,
        )  # fmt: skip
        record["other_ms"] = record["step_ms"] - sum(spans.get(k, 0.0) for k in CATEGORIES)
        if mode == "reference":
            ref_tps[seq_len] = record["tokens_per_s"]
        if seq_len in ref_tps and mode != "reference":
            record["scaling_efficiency"] = record["tokens_per_s"] / (len(participants) * ref_tps[seq_len])
    except (StepOutOfMemory, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)) as err:
        record.update(status="oom", error=str(err).splitlines()[0][:300])
    except Exception as err:  # keep measuring the other points; the traceback goes to stderr
        traceback.print_exc()
        record.update(
            status="error",
            error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
        )
    finally:
        model.clear_attention_cache()
        optimizer.zero_grad(set_to_none=True)
        timer.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


# -- driver ----------------------------------------------------------------------------------------------
def _build(args, device) -> tuple[BDLMModel, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    if args.model_config:  # a transformers config (with model_type), e.g. benchmarks/configs/gemma3-1b-shape.json
        config = json.loads(Path(args.model_config).read_text())
        if args.smoke:  # the same family at tiny width, one sliding + one full layer when it has both kinds
            config.update({k: v for k, v in SMOKE_SHAPES.items() if k in config})
            config["num_hidden_layers"] = 2
            if "layer_types" in config:
                config["layer_types"] = sorted(set(config["layer_types"]), reverse=True)[:2] * (
                    2 // len(set(config["layer_types"]))
                )
    else:
        config = dict(TINY_CONFIGS["qwen3"]) if args.smoke else dict(QWEN3_1_7B)
    with torch.device(device):  # initialise on the device (a 1.7B init on the CPU takes minutes)
        model = BDLMModel.from_config(
            config, dtype=torch.float32, block_size=args.block_size, backend=args.backend,
            experts_implementation=args.experts_implementation,
        )  # fmt: skip
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)
    if args.checkpointing:
        model.enable_activation_checkpointing()
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda" or None
    )
    return model, optimizer


def _summary(records: list[dict]) -> str:
    head = (
        f"{'mode':<10}{'ctx':>8}{'P':>3}{'status':>7}{'step_s':>9}{'tok/s':>10}{'peak_GiB':>9}{'eff':>6}"
        + "".join(f"{k:>10}" for k in ("attn_ms", "mlp_ms", "loss_ms", "comm_ms", "other_ms"))
    )
    lines = [head]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"{r['mode']:<10}{r['context_len']:>8}{r['world_size']:>3}{r['status']:>7}")
            continue
        eff = r.get("scaling_efficiency")
        lines.append(
            f"{r['mode']:<10}{r['context_len']:>8}{r['world_size']:>3}{'ok':>7}{r['step_ms'] / 1e3:>9.3f}"
            f"{r['tokens_per_s']:>10.0f}{r['peak_mem_gib']:>9.2f}{'' if eff is None else f'{eff:.2f}':>6}"
            + "".join(
                f"{r[k]:>10.1f}" for k in ("attention_ms", "mlp_ms", "loss_ms", "exposed_comm_ms", "other_ms")
            )
        )
    return "\n".join(lines)


def _rank_main(rank: int, world: int, args) -> None:
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.set_float32_matmul_precision("high")
        import torch._dynamo.config as dynamo_config

        for name in ("cache_size_limit", "recompile_limit"):  # one flex kernel per attention shape
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, 256)
        for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, 4096)
    model, optimizer = _build(args, device)
    timer = SpanTimer(device)
    instrument_mlps(model, timer)
    single = dist.new_group([0])
    ref_tps: dict[int, float] = {}
    records = []
    for seq_len in args.contexts:
        for mode in args.modes:
            fresh_point()  # no mode inherits another's compiled kernels (bench/isolation.py)
            record = run_point(args, model, optimizer, timer, single, mode, seq_len, device, ref_tps)
            if rank == 0 and record is not None:
                records.append(record)
                write(args.out, record)
                print(_summary(records[-1:]).splitlines()[-1], flush=True)
            if mode == "reference":  # rank 0's single-GPU number is everyone's baseline
                t = torch.tensor([ref_tps.get(seq_len, 0.0)], dtype=torch.float64, device=device)
                dist.broadcast(t, src=0)
                if t.item() > 0:
                    ref_tps[seq_len] = float(t.item())
            dist.barrier()
    if rank == 0:
        print(_summary(records), flush=True)


OBJECTIVES = {"sft": SFTObjective, "convert": ConvertObjective}

# --smoke with --model-config: the config's family and layer types at tiny width (2 layers kept as listed)
SMOKE_SHAPES = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                    sliding_window=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", required=True, help="records file (JSON lines), e.g. benchmarks/results/bdlm_sft.jsonl"
    )
    p.add_argument("--contexts", type=size_arg("--contexts"), nargs="+", default=[65536, 131072, 262144], help="clean tokens")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--breakdown-modes",
        nargs="*",
        choices=MODES,
        default=["csbp", "cp"],
        help="modes that also run the no-communication control step for the breakdown",
    )
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--objective", choices=list(OBJECTIVES), default="sft", help="also the record's workload")
    p.add_argument("--steps", type=int, default=2, help="timed steps per point")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per point (compile, block masks)")
    p.add_argument("--ce-chunk-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "dense", "flex"], default="auto")
    p.add_argument("--schedule", choices=["fused", "overlap"], default="fused",
                   help="CSBP/CP attention: one call after the all-gather, or overlap it with local attention")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: known GPUs)"
    )
    p.add_argument("--timeout-s", type=float, default=900.0, help="collective timeout")
    p.add_argument("--smoke", action="store_true", help="tiny Qwen3 on 2 CPU gloo ranks, float32 (a test)")
    p.add_argument("--model-config", default=None,
                   help="a transformers config JSON with model_type (default: Qwen3-1.7B shapes)")
    p.add_argument("--experts-implementation", default=None,
                   help="MoE experts kernel passed to transformers (e.g. eager, grouped_mm; default: its own)")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts = [c for c in args.contexts if c <= 64] or [32, 40]
        args.block_size, args.steps, args.warmup = 4, 1, 1
        args.backend, args.ce_chunk_size = "dense", 16
    args.autocast = not args.smoke
    if args.model_config:
        args.model_name = Path(args.model_config).stem + ("-tiny" if args.smoke else "")
    else:
        args.model_name = "qwen3-tiny" if args.smoke else "Qwen3-1.7B-shapes"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        spawn(_rank_main, 2, args, timeout_s=args.timeout_s)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_from_env(timeout_s=args.timeout_s)
        try:
            _rank_main(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        print("bdlm_bench: run under torchrun (GPUs) or with --smoke (CPU)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
