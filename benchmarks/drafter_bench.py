"""DFlash / DFlash2 drafter training step (forward + backward), synthetic features, in modes csbp / cp / dp
and SpecForge 0.2.0's own `OnlineDFlashModel` ("specforge", 1 GPU).

    # 2 GPUs: CSBP vs CP vs DP, shape (a) with DFlash2's conv + selector
    torchrun --nproc-per-node 2 benchmarks/drafter_bench.py --shape a --modes csbp,cp,dp \
        --contexts 128K,512K --anchors 512,2048 --out benchmarks/results/drafter.jsonl
    # 1 GPU: ours vs SpecForge on the identical DFlash architecture (conv and selector off)
    python benchmarks/drafter_bench.py --shape a --no-dflash2 --modes csbp,specforge \
        --contexts 64K,128K,256K,512K --anchors 512 --out benchmarks/results/drafter.jsonl
    # one point (the sweep contract, specforge_csbp/bench/grid.py)
    torchrun --nproc-per-node 2 benchmarks/drafter_bench.py --mode csbp --world-size 2 \
        --context-len 131072 --block-size 16 --anchors 512 --out FILE
    # tiny CPU/gloo run of every code path (2 ranks + 1-process points)
    python benchmarks/drafter_bench.py --smoke --out /tmp/drafter_smoke.jsonl

Shapes: (a) "qwen3.6-27b": SpecForge's qwen3.6-27b-dflash drafter - hidden 5120, 32/8 heads of 128, 4
sliding-window layers (2048) + 1 full layer, 5 target layers, vocab 248320, block 16 (DFlash2 on by
default: conv 2 taps / groups of 16, selector rank 256 / top-16); (b) "qwen3-8b": SpecForge's
qwen3-8b-dflash - hidden 4096, 5 full layers, vocab 151936 (DFlash by default).

Per point (one record, rank 0): step ms (median, max over ranks), supervised draft tokens/s (whole job),
peak HBM (max over ranks), useful TFLOP/s per GPU and MFU against --peak-tflops (FLOPs of the step counted
once: no duplicated block-local work, no recomputation), exposed communication (step minus the same step with
collectives replaced by local copies), and with --components (default on) the component times of this rank's
share - context projection, block-local decoder, vocabulary loss + selector, attention per layer type - and
the ceiling of CSBP over CP they imply:

    ceiling = (C + A/P + D) / (C + A/P + D/P)    C context projection per rank, A attention of the whole
                                                 step, D block-local work (decoder, loss, selector) of all anchors

An out-of-memory point is recorded with status "oom"; with several ranks the run then stops (a rank that ran
out of memory cannot rejoin the others' collectives), so later points need a new launch.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # nocomm.py, also when imported from a file

from nocomm import no_attention_communication  # noqa: E402

from specforge_csbp.bench.grid import parse_size
from specforge_csbp.bench.isolation import compiled_graphs, fresh_point, warm_up
from specforge_csbp.bench.provenance import library_digest
from specforge_csbp.bench.records import BenchRecord, write_records
from specforge_csbp.distributed.collectives import CommStats
from specforge_csbp.models.dflash import (
    DFlash2DraftModel,
    DFlashDraftModel,
    DrafterSample,
    drafter_step,
    make_dflash_config,
    plan_attention,
)
from specforge_csbp.models.dflash.configuration import DFlashConfig, plain_dflash
from specforge_csbp.models.dflash.prefetch import StepPrefetcher, stage_indices
from specforge_csbp.models.dflash.sharding import prepare_plan_attention, reference_attention
from specforge_csbp.models.dflash.step import plan_sample, prepare_step
from specforge_csbp.objectives.dflash import DFlashObjective, block_targets, loss_terms, sample_anchors
from specforge_csbp.parallel.options import AttentionOptions, resolve_schedule

SHAPES = {
    "a": {
        "name": "qwen3.6-27b", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 248320, "num_target_layers": 64,
        "target_layer_ids": [5, 19, 33, 47, 61], "mask_token_id": 248070, "block_size": 16, "rope_theta": 1e7,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048, "dflash2": True,
    },
    "b": {
        "name": "qwen3-8b", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "num_target_layers": 36, "target_layer_ids": None,
        "mask_token_id": 151669, "block_size": 16, "rope_theta": 1e6, "layer_types": ["full_attention"] * 5,
        "sliding_window": None, "dflash2": False,
    },
    "tiny": {  # --smoke
        "name": "tiny", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 997, "num_target_layers": 8, "target_layer_ids": [1, 4, 6],
        "mask_token_id": 996, "block_size": 4, "rope_theta": 1e4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 24, "dflash2": True,
    },
}  # fmt: skip
OUR_MODES = ("csbp", "cp", "dp")
ALL_MODES = OUR_MODES + ("specforge",)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["a", "b", "tiny"], default="a", help="tiny: the --smoke shape")
    p.add_argument("--draft-config", default=None,
                   help="a drafter config.json (drafter_configs/) instead of --shape: the drafter a recipe trains")
    p.add_argument("--dflash2", action=argparse.BooleanOptionalAction, default=None,
                   help="conv + selector on/off (default: on for shape a, off for b)")  # fmt: skip
    p.add_argument("--modes", default="csbp,cp,dp", help=f"comma separated, of {', '.join(ALL_MODES)}")
    p.add_argument("--mode", default=None, help="one mode (sweep contract); overrides --modes")
    p.add_argument("--contexts", default="128K,512K", help="context tokens, comma separated (64K, 1M, ...)")
    p.add_argument("--context-len", type=int, default=None, help="one context (sweep contract)")
    p.add_argument("--anchors", default="512,2048", help="anchors per sequence, comma separated")
    p.add_argument("--world-size", type=int, default=None, help="must equal the launch's world size if given")
    p.add_argument("--block-size", type=int, default=None, help="must equal the shape's block size if given")
    p.add_argument("--warmup", type=int, default=4,
                   help="untimed steps at least, then on until a step compiles nothing (CSBP's per-rank "
                   "row counts can first change in a late step: a static kernel recompiled then)")
    p.add_argument("--max-warmup", type=int, default=8,
                   help="untimed steps at most: warm-up runs on while a step compiles new graphs (bench/isolation.py)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--components", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--bucket", type=int, default=4096, help="sliding-plan row padding (static kernel shapes)")
    p.add_argument("--regather", action="store_true",
                   help="csbp: free gathered context K/V after forward, gather again in backward (memory)")
    p.add_argument("--schedule", choices=["fused", "overlap"], default=None,
                   help="csbp: one fused attention call after the gather (default; overlap with --regather), "
                   "or overlap the gather with attention over the local keys")
    p.add_argument("--peak-tflops", type=float, default=781.0, help="bf16 GEMM peak per GPU for MFU")
    p.add_argument("--keep-logits-gib", type=float, default=0.0,
                   help="vocabulary loss: keep the chunks' logits for backward up to this size instead of "
                   "recomputing them (0: recompute; objectives/linear_ce_topk.py)")
    p.add_argument("--prefetch-masks", action=argparse.BooleanOptionalAction, default=True,
                   help="build the next step's attention masks in a worker thread on a side stream (prefetch.py)")
    p.add_argument("--pack-gqa", choices=["auto", "on", "off"], default="auto",
                   help="GQA head packing in the attention seam (auto: decided from the block masks)")
    p.add_argument("--gather-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="CSBP: start each layer's context K/V gather one layer early (LayerAttention.gather_ahead; "
                   "the default, docs/performance.md); --no-gather-ahead: gather in front of each layer")
    p.add_argument("--check-context", type=int, default=0,
                   help="first check our modes' GPU path against the dense seam at this context (float32; 0: off)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="our modes: torch.compile the drafter's token-wise chains (DFlashDraftModel.compile_token_wise; "
                   "auto: on GPUs, as the plugin's csbp.compile does)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile", action="store_true", help="after timing, profile one step: top kernels to stdout"
    )
    p.add_argument("--out", default="benchmarks/results/drafter.jsonl")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: 2 gloo ranks, dense backend, float32")
    args = p.parse_args(argv)
    args.schedule = resolve_schedule(args.schedule, args.regather)  # the record names the one that ran
    args.pack = {"auto": None, "on": True, "off": False}[args.pack_gqa]
    return args


# -- setup ----------------------------------------------------------------------------------------------
def build_config(args):
    if args.draft_config:  # exactly the drafter a recipe trains (benchmarks/plugin_setup.py builds its data)
        config = DFlashConfig.from_json_file(args.draft_config)
        name = os.path.splitext(os.path.basename(args.draft_config))[0]
        if args.dflash2 is False and config.is_dflash2:  # the same drafter as plain DFlash (trainer_bench's too)
            with open(args.draft_config) as f:
                config = DFlashConfig.from_dict(plain_dflash(json.load(f)))
            name = name.replace("-dflash2", "-dflash")
        elif args.dflash2 and not config.is_dflash2:
            raise SystemExit(f"--draft-config {args.draft_config} is {config.architecture}; drop --dflash2")
        if args.block_size is not None and args.block_size != config.draft_block_size:
            raise SystemExit(f"--block-size {args.block_size} != the config's block size {config.draft_block_size}")
        return name, config
    shape = dict(SHAPES["tiny" if args.smoke else args.shape])
    name = shape.pop("name")
    if args.dflash2 is not None:
        shape["dflash2"] = args.dflash2
    if args.block_size is not None and args.block_size != shape["block_size"]:
        raise SystemExit(f"--block-size {args.block_size} != the shape's block size {shape['block_size']}")
    if shape["dflash2"]:
        shape.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8 if args.smoke else 256,
                     selector_top_k=16)  # fmt: skip
    return name, make_dflash_config(**shape)


class Env:
    def __init__(self, args):
        self.args = args
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        cuda = torch.cuda.is_available() and not args.smoke
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.dtype = torch.float32 if args.smoke else DTYPES[args.dtype]
        self.backend = "flex" if cuda else "dense"
        self.name = torch.cuda.get_device_name(self.device) if cuda else "cpu"

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reduce(self, value: float, op=None) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op or dist.ReduceOp.MAX)
        return float(t.item())

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return self.reduce(torch.cuda.max_memory_allocated(self.device) / 2**30)

    def reset_peak(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


class Features:
    """Synthetic target features of one sequence: only the requested intervals are ever materialised."""

    def __init__(self, intervals, width, env, seed, dtype=None):
        g = torch.Generator(device=env.device).manual_seed(seed)
        dtype = dtype or env.dtype
        self.parts = {iv: torch.randn(iv[1] - iv[0], width, device=env.device, dtype=dtype, generator=g)
                      for iv in intervals}  # fmt: skip

    def __call__(self, lo, hi):
        for (a, b), t in self.parts.items():
            if a <= lo and hi <= b:
                return t[lo - a : hi - a]
        raise KeyError(f"rows [{lo}, {hi}) were not generated on this rank")


def frozen_target(config, env, seed, dtype=None):
    g = torch.Generator(device=env.device).manual_seed(seed + 1)
    V, H, dtype = config.vocab_size, config.hidden_size, dtype or env.dtype
    head = (torch.randn(V, H, device=env.device, dtype=dtype, generator=g) * H**-0.5).requires_grad_(False)
    embed = torch.randn(V, H, device=env.device, dtype=dtype, generator=g).requires_grad_(False)
    return head, embed


def make_model(config, env, seed, dtype=None):
    torch.manual_seed(seed)
    cls = DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel
    with env.device:  # initialise on the device (a 27B-class drafter is ~2B parameters)
        model = cls(config).to(dtype=dtype or env.dtype)
    if config.is_dflash2:  # published checkpoints start as identity / zero; give every path real values
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "kernel_projection" in name or "successor_codebook" in name:
                    p.normal_(0.0, 0.02)
    return model


def sequence(L, config, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size - 1, (L,), generator=g)
    ids[ids == config.mask_token_id] = 0
    return ids, torch.ones(L)


# -- useful FLOPs ------------------------------------------------------------------------------------------
def useful_flops(config, L: int, anchors: torch.Tensor) -> float:
    """Forward + backward FLOPs of one sequence's step, every piece counted once (no duplicated block work,
    no recomputation; frozen features / LM head get no weight gradient): 2 FLOPs per multiply-add."""
    S, H, D, V = config.draft_block_size, config.hidden_size, config.head_dim, config.vocab_size
    hq, hk, inter, K = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        len(config.target_layer_ids),
    )
    N, a = anchors.numel(), anchors.to(torch.float64)
    flops = 2 * 2.0 * L * K * H * H  # fc: forward + weight gradient
    rows = N * S
    per_row = 2.0 * H * D * (2 * hq + 2 * hk) + 6.0 * H * inter  # q, k, v, o + gate, up, down
    flops += 3 * rows * per_row * config.num_hidden_layers
    slot = torch.arange(S, dtype=torch.float64)
    for kind in config.layer_types:
        if kind == "full_attention":
            ctx_rows = L
            pairs = float((a * S).sum()) + N * S * S
        else:
            W = config.sliding_window
            need = torch.zeros(L + 1)
            for x in anchors.tolist():
                need[max(0, x - W + 1) : x] = 1
            ctx_rows = float(need.sum())
            seen = torch.minimum(a[:, None], (W - 1 - slot).clamp(min=0)[None, :])
            block = (slot + 1).sum() if config.sliding_layers_causal else S * S
            pairs = float(seen.sum()) + N * float(block)
        flops += 3 * 2.0 * ctx_rows * H * 2 * hk * D  # context K/V projection: forward, dW, dX
        flops += 3.5 * 4.0 * D * hq * pairs  # attention: QK^T + PV forward, 2.5x that backward
    flops += 4.0 * N * (S - 1) * H * V  # vocabulary: logits forward + d hidden (frozen head)
    if config.is_dflash2:
        k, r = config.dflash2_field("selector_top_k"), config.dflash2_field("selector_rank")
        taps, groups = config.dflash2_field("conv_kernel_size"), H // config.dflash2_field("conv_group_size")
        flops += 3 * N * (S - 1) * (2.0 * H * r + 4.0 * k * r)  # selector: projection + k scores
        conv = 2.0 * H * 2 * taps * groups + 2 * 2.0 * taps * H  # kernel projection + the two convolutions
        flops += 3 * rows * config.num_hidden_layers * 2 * conv  # two wrapped sublayers per layer
    return flops


# -- one point, our modes ----------------------------------------------------------------------------------
def _time(fn, env, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        env.sync()
        t0 = time.perf_counter()
        fn()
        env.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_once(step, env, title: str) -> None:
    """One profiled step: the top ops by own device time, then the copy-like ops split by input shape
    (which concatenations, index copies and casts a step pays for)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = env.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        env.sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    copies = [e for e in prof.key_averages(group_by_input_shape=True)
              if e.key in ("aten::cat", "aten::copy_", "aten::index_select", "aten::index_add_", "aten::index_put_",
                           "aten::stack", "aten::contiguous", "aten::clone", "aten::zeros", "aten::fill_")]  # fmt: skip
    copies.sort(key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))
    rows = [f"{e.key:22s} {e.count:5d} calls {(e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3:9.2f} ms"
            f"  shapes {str(e.input_shapes)[:150]}" for e in copies[:20]]  # fmt: skip
    print(
        f"--- profile of one step: {title}\n" + prof.key_averages().table(sort_by=key, row_limit=40)
        + "\n--- copy-like ops by input shape (own device time)\n" + "\n".join(rows),
        flush=True,
    )


def step_health(env) -> dict[str, float]:
    """Counters of what can make a step slow without being its work: graphs compiled (torch.compile
    recompiling for new shapes) and, on CUDA, device allocations / frees and allocator retries (cudaMalloc
    and cudaFree synchronise). The record holds their increase over the timed steps."""
    out = {"compiled_graphs": float(compiled_graphs())}
    if env.device.type == "cuda":
        m = torch.cuda.memory_stats(env.device)
        for key in ("num_device_alloc", "num_device_free", "num_alloc_retries"):
            out[key] = float(m.get(key, 0))
    return out


def components(model, plan, sample, head, embed, objective, env, fresh_plans=()) -> dict[str, float]:
    """This rank's share of one step, piece by piece (forward + backward each; collectives off).
    `prep_ms`: building one step's attention executors and all their masks (tables, GQA packing decision,
    block masks) for a plan not seen before - `fresh_plans` (anchors of other steps) - which a real step
    does inside its forward pass and the attention pieces here (masks cached) do not."""
    cfg, S = model.config, model.block_size
    dev, dt = env.device, env.dtype
    feats = [sample.features(lo, hi)[None] for lo, hi in plan.ctx_intervals]  # pieces, as the step reads them
    rope_ctx = model.rotary_emb(feats[0], plan.ctx_positions.reshape(1, -1).to(dev))
    blocks = block_targets(sample.input_ids, sample.loss_mask, plan.owned_anchors, S, model.mask_token_id,
                           vocab_size=cfg.vocab_size)  # fmt: skip
    pos = (plan.owned_anchors[:, None] + torch.arange(S)).reshape(-1)
    staged = stage_indices(plan, blocks, dev)  # as a prepared step has them: no index copy in the timed code
    out = {}

    def ctx_step():
        ctx = model.project_context(feats)
        total = 0
        for layer in model.layers:
            idx = staged.ctx_index[layer.layer_type]
            c, cs = (ctx, rope_ctx) if idx is None else (ctx[:, idx], tuple(t[:, idx] for t in rope_ctx))
            k, v = layer.self_attn.context_kv(c, *cs)
            total = total + k.float().mean() + v.float().mean()
        total.backward()

    out["ctx_ms"] = _time(ctx_step, env, 1, env.args.iters)
    x0 = torch.nn.functional.embedding(blocks.draft_ids.to(dev).reshape(1, -1), embed).to(dt)
    rope_q = model.rotary_emb(x0, pos.reshape(1, -1).to(dev))
    empty_ctx, rope_empty = x0[:, :0], tuple(t[:, :0] for t in rope_q)
    # the block-local decoder: every layer with attention over the block's own keys only
    block_attn = reference_attention(
        cfg, plan.owned_anchors, torch.zeros(0, dtype=torch.long), options=AttentionOptions(backend=env.backend)
    )

    def block_step():
        x = x0
        for layer in model.layers:
            x = layer(x, empty_ctx, rope_q, rope_empty, block_attn[layer.layer_type].attend)
        model.norm(x).float().mean().backward()

    out["block_ms"] = _time(block_step, env, 1, env.args.iters)
    hidden = torch.randn(1, pos.numel(), cfg.hidden_size, device=dev, dtype=dt, requires_grad=True)
    selector = getattr(model, "candidate_selector", None)

    def loss_step():
        loss_terms(hidden[0], head, blocks, objective, selector=selector, index=staged.loss).numerator.backward()

    out["loss_ms"] = _time(loss_step, env, 1, env.args.iters)
    options = AttentionOptions(backend=env.backend, stats=CommStats(), schedule=env.args.schedule,
                               pack_gqa=env.args.pack)  # fmt: skip
    attention = plan_attention(plan, group=dist.group.WORLD if plan.world_size > 1 else None, options=options)
    for kind, spec in attention.items():
        lp = plan.layers[kind]
        q = torch.randn(
            1,
            cfg.num_attention_heads,
            lp.shard.q_rows.numel(),
            cfg.head_dim,
            device=dev,
            dtype=dt,
            requires_grad=True,
        )
        k = torch.randn(
            1,
            cfg.num_key_value_heads,
            lp.shard.kv_rows.numel(),
            cfg.head_dim,
            device=dev,
            dtype=dt,
            requires_grad=True,
        )
        v = torch.randn_like(k, requires_grad=True)

        def attn_step(spec=spec, q=q, k=k, v=v):
            o, _ = spec.attend(q, k, v)
            o.float().mean().backward()

        with no_attention_communication():  # this rank's attention work alone (benchmarks/nocomm.py)
            ms = _time(attn_step, env, 1, env.args.iters)
        out[f"attn_{kind.split('_')[0]}_ms"] = ms * cfg.layer_types.count(kind)
    prep = []
    for fresh in fresh_plans:
        env.sync()
        t = time.perf_counter()
        fresh_attention = plan_attention(
            fresh, group=dist.group.WORLD if fresh.world_size > 1 else None, options=options
        )
        prepare_plan_attention(fresh_attention, dev, cfg.num_attention_heads // cfg.num_key_value_heads)
        env.sync()
        prep.append(1e3 * (time.perf_counter() - t))
    if prep:
        out["prep_ms"] = statistics.median(prep)
    model.zero_grad(set_to_none=True)
    return out


def make_samples(mode, L, N, config, width, env, seed, dtype=None):
    """The step's objective and this rank's sequences (features generated only for its own intervals)."""
    P = env.world
    keep = getattr(env.args, "keep_logits_gib", 0.0)
    objective = DFlashObjective(num_anchors=N, seed=seed, chunk_size=2048, keep_logits_gib=keep)
    samples = []
    for i, (ids, mask) in enumerate(sequence(L, config, seed + i) for i in range(P if mode == "dp" else 1)):
        if mode == "dp" and i % P != env.rank:
            samples.append(DrafterSample(ids, mask, None))  # another rank's sequence: never read here
            continue
        # the context rows this rank reads, from the plan the shared step makes (step.plan_sample)
        plan, _ = plan_sample(config, DrafterSample(ids, mask, None), objective=objective, mode=mode, world=P,
                              rank=env.rank, step=0, sample_index=i)  # fmt: skip
        feats = Features(plan.ctx_intervals, width, env, seed + 100 + i, dtype)
        samples.append(DrafterSample(ids, mask, feats))
    return objective, samples


def check_backends(args, env, modes) -> dict[str, float]:
    """The GPU path (FlexAttention: block masks, GQA packing, compiled kernels) against the dense seam on the
    same device, float32, at `--check-context` tokens: the largest relative error over the loss and every
    trainable gradient, per mode (max over ranks). The CPU tests prove the parallel logic in float64; this
    proves the GPU kernels compute the same function."""
    _, config = build_config(args)
    L, N = args.check_context, max(4 * env.world, 32)
    model = make_model(config, env, args.seed, torch.float32)
    head, embed = frozen_target(config, env, args.seed, torch.float32)
    errors = {}
    for mode in modes:
        objective, samples = make_samples(mode, L, N, config, model.fc.in_features, env, args.seed, torch.float32)
        out = {}
        # the reference is the dense seam in row order, gathers in place; on CPU (--smoke) dense twice: the
        # path runs, error 0 (or the rounding of --gather-ahead's other order)
        for backend, checked in (("dense", False), (env.backend, True)):
            model.zero_grad(set_to_none=True)
            options = AttentionOptions(backend=backend, stats=CommStats(), regather=args.regather,
                                       schedule=args.schedule, pack_gqa=args.pack,
                                       gather_ahead=checked and args.gather_ahead)  # fmt: skip
            res = drafter_step(
                model, samples, objective=objective, mode=mode, head_weight=head, embed_weight=embed, step=0,
                bucket=args.bucket, options=options,
            )  # fmt: skip
            out[backend] = (res.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        (ref_loss, ref_grads), (loss, grads) = out["dense"], out[env.backend]
        err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
        for n, g in ref_grads.items():
            err = max(err, float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)))
        errors[mode] = env.reduce(err)
        if env.rank == 0:
            print(f"check {mode}: {env.backend} vs dense seam on {env.name}, float32, L={L} N={N}: max rel err "
                  f"{errors[mode]:.2e}", flush=True)  # fmt: skip
    del model, head, embed
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return errors


def run_ours(mode, L, N, config, model, head, embed, env, args) -> dict:
    P = env.world
    objective, samples = make_samples(mode, L, N, config, model.fc.in_features, env, args.seed)
    stats = CommStats()
    box = {}
    # anchors are re-drawn every step; the next step's plans (and, with --prefetch-masks, its attention
    # executors and masks, on a side stream) are built in a worker thread while this one runs
    def prepare(i):
        return prepare_step(config, samples, objective=objective, mode=mode, step=i, bucket=args.bucket)

    groups = config.num_attention_heads // config.num_key_value_heads
    options = AttentionOptions(backend=env.backend, stats=stats, regather=args.regather, schedule=args.schedule,
                               pack_gqa=args.pack, gather_ahead=args.gather_ahead)  # fmt: skip
    prefetcher = StepPrefetcher(prepare, options, device=env.device, groups=groups, masks=args.prefetch_masks)
    state = {"i": 0}

    def step():
        i = state["i"]
        prepared = prefetcher.take(i)
        state["i"] = i + 1
        model.zero_grad(set_to_none=True)
        box["res"] = drafter_step(
            model, samples, objective=objective, mode=mode, head_weight=head, embed_weight=embed, step=i,
            bucket=args.bucket, options=options, prepared=prepared,
        )  # fmt: skip

    warmup_steps = warm_up(step, args.warmup, max(args.warmup, args.max_warmup), agree=env.reduce)
    env.reset_peak()
    stats.reset()
    before = step_health(env)
    step_ms = env.reduce(_time(step, env, 0, args.iters))
    timed_health = {k: env.reduce(v - before[k]) for k, v in step_health(env).items()}  # max over ranks
    peak = env.peak_gib()
    res = box["res"]
    rec = {"step_ms": step_ms, "peak_mem_gib": peak, "tokens_per_s": res.metrics["supervised"] / (step_ms / 1e3),
               "comm_bytes_per_step": env.reduce(sum(stats.bytes_sent.values()) / args.iters),
           "timed_steps_health": timed_health, "warmup_steps": warmup_steps,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}  # fmt: skip
    flops = (
        sum(useful_flops(config, L, p.anchors) for p in res.plans)
        if mode == "dp"
        else useful_flops(config, L, res.plans[0].anchors)
    )
    flops = env.reduce(flops, dist.ReduceOp.SUM) if mode == "dp" else flops
    rec["useful_tflops_per_gpu"] = flops / (step_ms / 1e3) / P / 1e12
    rec["mfu"] = rec["useful_tflops_per_gpu"] / args.peak_tflops
    if P > 1 and mode in ("csbp", "cp"):
        with no_attention_communication():  # the same steps, attention collectives as local copies
            warm_up(step, 1, max(1, args.max_warmup), agree=env.reduce)
            nocomm = _time(step, env, 0, args.iters)
        nocomm = env.reduce(nocomm)
        rec["exposed_comm_ms"] = max(0.0, step_ms - nocomm)
    if args.profile and env.rank == 0:
        profile_once(step, env, f"{mode} P={P} L={L} N={N}")
    elif args.profile:
        step()  # the other ranks take part in the profiled step's collectives
    if args.components and mode != "dp":
        plan = res.plans[0]
        sample = next(s for s in samples if s.features is not None)
        fresh = [prepare(1000 + j)[0][1] for j in range(args.iters)]  # plans of steps not run yet
        comp = components(model, plan, sample, head, embed, objective, env, fresh)
        rec["components_ms"] = {k: env.reduce(v) for k, v in comp.items()}
        attn = sum(v for k, v in comp.items() if k.startswith("attn_"))
        if P > 1:
            A = env.reduce(attn, dist.ReduceOp.SUM)  # attention of the whole step
            own = comp["block_ms"] + comp["loss_ms"]
            D = env.reduce(own, dist.ReduceOp.SUM) if mode == "csbp" else env.reduce(own)  # all anchors
            C = env.reduce(comp["ctx_ms"])
            rec["ceiling"] = (C + A / P + D) / (C + A / P + D / P)
            rec["components_ms"].update(attention_total_ms=A, block_local_all_anchors_ms=D)
    model.zero_grad(set_to_none=True)
    prefetcher.close()
    return rec


class ModeUnavailable(RuntimeError):
    """A mode that cannot run in this launch (recorded as an error; the other modes go on)."""


# -- one point, SpecForge ----------------------------------------------------------------------------------
def run_specforge(L, N, config, head, embed, env, args) -> dict:
    try:
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel as SpecForgeDraft
    except ImportError as err:
        raise ModeUnavailable(
            f"mode specforge needs the specforge==0.2.0 wheel (pip install --no-deps specforge==0.2.0): {err}"
        )
    if config.is_dflash2:
        raise ModeUnavailable("mode specforge runs SpecForge's DFlash architecture: add --no-dflash2")
    if env.world != 1:
        raise ModeUnavailable("mode specforge is a 1-GPU mode: launch without torchrun / with one process")
    from transformers import Qwen3Config

    qc = Qwen3Config(
        **{k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
    )
    qc._attn_implementation = "flex_attention" if env.device.type == "cuda" else "sdpa"
    torch.manual_seed(args.seed)
    with env.device:
        draft = SpecForgeDraft(qc).to(dtype=env.dtype)
    lm_head = torch.nn.Linear(
        config.hidden_size, config.vocab_size, bias=False, device=env.device, dtype=env.dtype
    )
    lm_head.weight.data.copy_(head)
    emb = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=env.device, dtype=env.dtype)
    emb.weight.data.copy_(embed)
    for p in (*lm_head.parameters(), *emb.parameters()):
        p.requires_grad_(False)
    online = OnlineDFlashModel(
        draft, lm_head, emb, mask_token_id=config.mask_token_id, block_size=config.draft_block_size,
        attention_backend="flex_attention" if env.device.type == "cuda" else "sdpa", num_anchors=N,
        loss_decay_gamma=7.0,
    )  # fmt: skip
    ids, mask = sequence(L, config, args.seed)
    feats = Features([(0, L)], draft.fc.in_features, env, args.seed + 100)(0, L)[None]
    ids, mask = ids[None].to(env.device), mask[None].to(env.device)
    box = {}

    def step():
        draft.zero_grad(set_to_none=True)
        loss, _, metrics = online(ids, feats, mask)
        loss.backward()
        box["sup"] = metrics["accuracy_denom"]

    warmup_steps = warm_up(step, args.warmup, max(args.warmup, args.max_warmup))
    env.reset_peak()
    step_ms = _time(step, env, 0, args.iters)
    sup = float(box["sup"])
    anchors = sample_anchors(
        mask[0].cpu(), DFlashObjective(num_anchors=N), block_size=config.draft_block_size
    )
    tflops = useful_flops(config, L, anchors) / (step_ms / 1e3) / 1e12
    out = {"step_ms": step_ms, "peak_mem_gib": env.peak_gib(), "tokens_per_s": sup / (step_ms / 1e3),
               "useful_tflops_per_gpu": tflops, "mfu": tflops / args.peak_tflops, "warmup_steps": warmup_steps}  # fmt: skip
    return out


# -- driver ---------------------------------------------------------------------------------------------------
def command_line(env) -> str:
    argv = [os.path.relpath(sys.argv[0])] + sys.argv[1:]
    if env.world > 1 and not env.args.smoke:  # --smoke starts its own gloo ranks
        return shlex.join(["torchrun", f"--nproc-per-node={env.world}"] + argv)
    return shlex.join(["python"] + argv)


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def run_points(args, env, points):
    name, config = build_config(args)
    ours = list(dict.fromkeys(m for m, _, _ in points if m != "specforge"))
    checked = check_backends(args, env, ours) if args.check_context and ours else {}
    head, embed = frozen_target(config, env, args.seed)
    model = None
    compiled = args.compile == "on" or (args.compile == "auto" and env.device.type == "cuda")
    records = []
    for mode, L, N in points:
        fresh_point()  # no mode inherits another's compiled kernels (bench/isolation.py)
        # what earlier points of this launch still hold (our model's weights; anything more is a leftover that
        # the point's peak will include, e.g. after mode specforge: docs/performance.md)
        held = torch.cuda.memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else 0.0
        base = {"workload": f"drafter-{name}", "mode": mode, "world_size": 1 if mode == "specforge" else env.world,
                    "context_len": L, "block_size": config.draft_block_size, "anchors": N, "dflash2": config.is_dflash2,
                    "regather": args.regather, "schedule": args.schedule, "pack_gqa": args.pack_gqa,
                    **({} if mode == "specforge" else {"gather_ahead": args.gather_ahead}),
                    **({} if mode == "specforge" else {"prefetch_masks": args.prefetch_masks}), "fresh_compile": True, "start_allocated_gib": held,
                    **({"keep_logits_gib": args.keep_logits_gib} if args.keep_logits_gib and mode != "specforge" else {}),
                    **({} if mode == "specforge" else {"compile_token_wise": compiled}),
                    **({"check_rel_err": checked[mode]} if mode in checked else {}),
                    "device": env.name, "date": datetime.date.today().isoformat(), "code": library_digest(),
                    "command": command_line(env)}  # fmt: skip
        try:
            if mode == "specforge":
                rec = run_specforge(L, N, config, head, embed, env, args)
            else:
                if model is None:
                    model = make_model(config, env, args.seed)
                    if compiled:
                        model.compile_token_wise()
                rec = run_ours(mode, L, N, config, model, head, embed, env, args)
            record = BenchRecord(**base, **rec)
        except ModeUnavailable as err:  # e.g. no specforge wheel: the other modes go on
            print(f"[rank {env.rank}] {mode}: not run: {err}", flush=True)
            record = BenchRecord(**base, status="error", error=str(err))
        except Exception as err:  # every failure becomes a record
            status = "oom" if is_oom(err) else "error"
            print(
                f"[rank {env.rank}] {mode} L={L} N={N}: {status}: {str(err).splitlines()[0][:300]}",
                flush=True,
            )
            record = BenchRecord(**base, status=status, error=str(err).splitlines()[0][:300])
            if env.world > 1:  # this rank cannot rejoin the group's collectives: record and stop the launch
                write_records(args.out, [record])
                os._exit(3)
            if status == "error":
                raise
            gc.collect()
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
        records.append(record)
        if env.rank == 0:
            write_records(args.out, [record])
            show(record)
        gc.collect()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def show(r: BenchRecord) -> None:
    extra = r.model_extra or {}
    line = (f"{r.workload} {r.mode:9s} P={r.world_size} L={r.context_len:>8d} N={extra.get('anchors')}: "
            f"{r.status}")  # fmt: skip
    if r.status == "ok":
        line += (f" step {r.step_ms:9.1f} ms  {r.tokens_per_s:10.0f} tok/s  peak {r.peak_mem_gib or 0:6.1f} GiB"
                 f"  MFU {extra.get('mfu', 0):.2f}  warm-up {extra.get('warmup_steps', '?')} steps")  # fmt: skip
        if r.exposed_comm_ms is not None:
            line += f"  exposed comm {r.exposed_comm_ms:.1f} ms"
        health = extra.get("timed_steps_health")
        if health and any(health.values()):
            line += "\n    during the timed steps: " + ", ".join(f"{k} +{v:.0f}" for k, v in health.items())
        comp = extra.get("components_ms")
        if comp:
            line += "\n    components (ms, this rank's share): " + ", ".join(
                f"{k}={v:.1f}" for k, v in comp.items()
            )
        if "ceiling" in extra:
            line += f"\n    ceiling of CSBP over CP: {extra['ceiling']:.2f}x"
    print(line, flush=True)


def summarize(records):
    """CSBP / CP ratio next to the ceiling, for points measured in this launch."""
    ok = {
        (r.mode, r.context_len, (r.model_extra or {}).get("anchors")): r for r in records if r.status == "ok"
    }
    for (mode, L, N), r in sorted(ok.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        cp = ok.get(("cp", L, N))
        if mode == "csbp" and cp is not None:
            ceiling = (r.model_extra or {}).get("ceiling") or (cp.model_extra or {}).get("ceiling")
            print(f"L={L} N={N}: CSBP/CP = {cp.step_ms / r.step_ms:.3f}x (ceiling {ceiling or float('nan'):.3f}x), "
                  f"peak HBM {r.peak_mem_gib} vs {cp.peak_mem_gib} GiB", flush=True)  # fmt: skip


def plan_points(args):
    modes = [args.mode] if args.mode else [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        raise SystemExit(f"mode must be one of {', '.join(ALL_MODES)}; got {', '.join(bad)}")
    contexts = (
        [args.context_len]
        if args.context_len
        else [parse_size(c) for c in args.contexts.split(",") if c.strip()]
    )
    anchors = [int(a) for a in args.anchors.split(",") if a.strip()]
    # small contexts first, so a mode's memory limit is found from below; ours before SpecForge's
    return [(m, L, N) for N in anchors for L in sorted(contexts) for m in modes]


def _smoke_worker(rank, world, args):
    env = Env(args)
    run_points(args, env, [(m, 256, 13) for m in OUR_MODES])


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        from specforge_csbp.distributed import spawn

        args.iters, args.warmup, args.bucket, args.check_context = 1, 1, 8, 128
        spawn(_smoke_worker, 2, args, timeout_s=300)
        env = Env(args)  # the 1-process points: ours on one rank, then SpecForge's own model (DFlash)
        records = run_points(args, env, [("csbp", 256, 13)])
        if not args.draft_config:  # a config file is one drafter: no DFlash variant of it to put beside SpecForge
            args.dflash2 = False
            records += run_points(args, env, [("csbp", 256, 13), ("specforge", 256, 13)])
        if not all(r.status == "ok" for r in records):
            raise SystemExit("smoke run had failures")
        return 0
    if "WORLD_SIZE" in os.environ:
        from specforge_csbp.distributed.launch import init_from_env

        init_from_env()
    env = Env(args)
    if args.world_size is not None and args.world_size != env.world:
        raise SystemExit(f"--world-size {args.world_size} != launched world size {env.world}")
    records = run_points(args, env, plan_points(args))
    if env.rank == 0:
        summarize(records)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
