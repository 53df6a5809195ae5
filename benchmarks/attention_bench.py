"""One BDLM attention layer, forward + backward, in every mode, side by side in one launch.

    torchrun --nproc-per-node 2 benchmarks/attention_bench.py --out benchmarks/results/attention.jsonl

Modes: reference (rank 0 alone, 1 GPU, when it fits), cp, bp, csbp (this package, FlexAttention), and
torch-cp: PyTorch's own context-parallel FlexAttention (all-gather of K/V, head-tail load balancer) over
the same 2L sequence and the same BDLM mask rule. Before timing, every mode's output and dq are checked
against the single-GPU reference at --check-context (max relative error recorded as `check_rel_err`).

Per point: step ms (median over iterations, max over ranks), useful TFLOP/s per GPU (visible pairs only),
exposed communication (step time minus the same run with communication replaced by local copies; CP,
CSBP), peak memory (max over ranks). `--smoke` runs a tiny CPU/gloo version (dense backend, no torch-cp).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from nocomm import no_attention_communication

from specforge_csbp.bench.isolation import fresh_point
from specforge_csbp.bench.records import BenchRecord, write_records
from specforge_csbp.distributed.collectives import CommStats
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.layout.cost import attention_flops, bdlm_visible_pairs
from specforge_csbp.masks import Visibility
from specforge_csbp.parallel import AttentionOptions, ShardedAttention
from specforge_csbp.parallel.options import resolve_schedule
from specforge_csbp.values import parse_sizes

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768,65536,131072,262144", help="clean tokens L, comma separated")
    p.add_argument("--modes", default="reference,csbp,cp,bp,torch-cp")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reference-max-context", type=int, default=262144, help="skip the 1-GPU reference above this")
    p.add_argument("--check-context", type=int, default=4096, help="correctness check size (0: skip)")
    p.add_argument("--out", default="benchmarks/results/attention.jsonl")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (gloo, dense backend)")
    p.add_argument("--schedule", choices=["fused", "overlap"], default=None,
                   help="our modes: one fused call after the gather (default; overlap with --regather), "
                   "or overlap the gather with local attention + LSE merge")
    p.add_argument("--pack-gqa", choices=["auto", "on", "off"], default="auto",
                   help="our modes and the reference: GQA head packing in the seam (auto: from the block masks)")
    p.add_argument("--regather", action="store_true",
                   help="our modes: free gathered K/V after forward, gather again in backward (memory)")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one extra step per point")
    args = p.parse_args(argv)
    args.schedule = resolve_schedule(args.schedule, args.regather)  # the record names the one that ran
    args.pack = {"auto": None, "on": True, "off": False}[args.pack_gqa]
    return args


# --------------------------------------------------------------------------------------------------
# torch-cp: PyTorch's context parallel FlexAttention (module wrapper + head-tail load balancer)
# --------------------------------------------------------------------------------------------------
def _torch_cp_api():
    try:  # torch >= 2.10 layout
        from torch.distributed.tensor.experimental._context_parallel import (
            _context_parallel_shard,
            _ContextParallel,
            _HeadTailLoadBalancer,
        )
    except ImportError:  # older layout
        from torch.distributed.tensor.experimental._attention import (  # type: ignore[no-redef]
            _context_parallel_shard,
            _ContextParallel,
            _HeadTailLoadBalancer,
        )
    return _context_parallel_shard, _ContextParallel, _HeadTailLoadBalancer


class _Flex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from specforge_csbp.attention.flex import _compiled_flex

        self.flex = _compiled_flex()  # the same compiled kernel and settings as our modes

    def forward(self, q, k, v, *, block_mask):
        return self.flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


class TorchCP:
    """q/k/v are this rank's head-tail shard of the 2L reference-order sequence."""

    def __init__(self, seq_len, block_size, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from specforge_csbp.attention.flex import block_mask_for

        shard, ContextParallel, HeadTail = _torch_cp_api()
        world = dist.get_world_size()
        self.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        self.module = parallelize_module(
            _Flex(), self.mesh, ContextParallel(seq_dim=2, attention_type=ContextParallel.AttentionType.FLEX)
        )
        ref = bdlm_plan("reference", seq_len, block_size, 1)[0]
        vis = Visibility(ref.q_tokens, ref.kv_tokens, block_size)
        n = 2 * seq_len
        # Only mask_mod and the lengths of this mask are used by torch's sharding, which rebuilds the
        # per-rank mask itself; our chunked builder avoids materialising the 2L x 2L grid here.
        full_mask = block_mask_for(vis, device)
        self.balancer = HeadTail(n, world, device)
        self._shard = shard
        (self.block_mask,) = shard(self.mesh, [full_mask], [2], load_balancer=self.balancer)
        # Row ids (reference order) this rank holds after the head-tail rearrangement.
        rows = self.balancer._generate_indices(restore=False)[0].to("cpu")
        per = n // world
        self.rows = rows[dist.get_rank() * per : (dist.get_rank() + 1) * per]

    def __call__(self, q, k, v):
        return self.module(q, k, v, block_mask=self.block_mask), None


# --------------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(fn, q, k, v, grad, warmup, iters, device, barrier=True):
    for _ in range(warmup):
        out, _ = fn(q, k, v)
        out.backward(grad)
    times = []
    for _ in range(iters):
        for t in (q, k, v):
            t.grad = None
        _sync(device)
        if barrier:  # ranks start each step together; the 1-GPU reference runs alone
            dist.barrier()
        start = time.perf_counter()
        out, _ = fn(q, k, v)
        out.backward(grad)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _profile_step(fn, q, k, v, grad, title: str) -> None:
    """Top kernels of one forward + backward, printed by rank 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with profile(activities=activities) as prof:
        out, _ = fn(q, k, v)
        out.backward(grad)
        _sync(q.device)
    if dist.get_rank() != 0:
        return
    sort = "cuda_time_total" if q.is_cuda else "cpu_time_total"
    print(f"--- profile {title}\n" + prof.key_averages().table(sort_by=sort, row_limit=12), flush=True)


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _local_inputs(rows_q, rows_kv, args, device, dtype, full=None):
    """Random local q/k/v (or slices of `full` for correctness checks)."""
    if full is not None:
        q, k, v, g = full
        pick = lambda t, r: t[:, :, r.to(device)].detach().clone().requires_grad_()
        return pick(q, rows_q), pick(k, rows_kv), pick(v, rows_kv), g[:, :, rows_q.to(device)].contiguous()
    mk = lambda h, n: torch.randn(1, h, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    q, k, v = mk(args.heads, len(rows_q)), mk(args.kv_heads, len(rows_kv)), mk(args.kv_heads, len(rows_kv))
    return q, k, v, torch.randn(1, args.heads, len(rows_q), args.head_dim, device=device, dtype=dtype)


def _build(mode, seq_len, args, device):
    """(callable, q_rows, kv_rows) for this rank; None when this rank sits the mode out."""
    backend = "dense" if device.type == "cpu" else "flex"
    if mode == "torch-cp":
        cp = TorchCP(seq_len, args.block_size, device)
        return cp, cp.rows, cp.rows
    if mode == "reference":
        if dist.get_rank() != 0:
            return None
        plan = bdlm_plan("reference", seq_len, args.block_size, 1)[0]
        options = AttentionOptions(backend=backend, pack_gqa=args.pack)
        return ShardedAttention(plan, args.block_size, options=options), plan.q_rows, plan.kv_rows
    plan = bdlm_plan(mode, seq_len, args.block_size, dist.get_world_size())[dist.get_rank()]
    options = AttentionOptions(backend=backend, stats=CommStats(), schedule=args.schedule, regather=args.regather,
                               pack_gqa=args.pack)  # fmt: skip
    attn = ShardedAttention(plan, args.block_size, options=options)
    return attn, plan.q_rows, plan.kv_rows


def _check(modes, seq_len, args, device, dtype) -> dict[str, float]:
    """Max relative error of each mode's out and dq rows against the 1-GPU reference (same inputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = 2 * seq_len
    full = [torch.randn(1, h, n, args.head_dim, device=device, dtype=dtype, generator=gen)
            for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]  # fmt: skip
    ref_plan = bdlm_plan("reference", seq_len, args.block_size, 1)[0]
    backend = "dense" if device.type == "cpu" else "flex"
    ref = ShardedAttention(ref_plan, args.block_size, options=AttentionOptions(backend=backend))
    q, k, v, g = _local_inputs(ref_plan.q_rows, ref_plan.kv_rows, args, device, dtype, full)
    ref_out, _ = ref(q, k, v)
    ref_out.backward(g)
    errors = {}
    for mode in modes:
        if mode == "reference":
            continue
        built = _build(mode, seq_len, args, device)
        fn, rows_q, rows_kv = built
        lq, lk, lv, lg = _local_inputs(rows_q, rows_kv, args, device, dtype, full)
        out, _ = fn(lq, lk, lv)
        out.backward(lg)
        r = rows_q.to(device)
        num = torch.stack([(out.float() - ref_out[:, :, r].float()).abs().max(),
                           (lq.grad.float() - q.grad[:, :, r].float()).abs().max()])  # fmt: skip
        den = torch.stack([ref_out.float().abs().max(), q.grad.float().abs().max()])
        dist.all_reduce(num, op=dist.ReduceOp.MAX)
        errors[mode] = float((num / den).max().item())
    return errors


def run(args) -> list[BenchRecord]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = torch.float32 if args.smoke else DTYPES[args.dtype]
    world = dist.get_world_size()
    modes = [m for m in args.modes.split(",") if m]
    if device.type == "cpu" and "torch-cp" in modes:
        modes.remove("torch-cp")  # FlexAttention has no CPU backward
        if dist.get_rank() == 0:
            print("note: torch-cp needs GPUs (FlexAttention has no CPU backward); skipped")
    command = "torchrun --nproc-per-node %d benchmarks/attention_bench.py %s" % (world, " ".join(sys.argv[1:]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    device_desc = f"{world}x {name}"
    today = datetime.date.today().isoformat()
    checks = _check(modes, args.check_context, args, device, dtype) if args.check_context else {}
    if dist.get_rank() == 0 and checks:
        print("check vs reference at L=%d: %s" % (args.check_context, {m: f"{e:.2e}" for m, e in checks.items()}))
    records = []
    for seq_len in parse_sizes(args.contexts, field="--contexts"):
        pairs = bdlm_visible_pairs(seq_len, args.block_size)
        flops = attention_flops(pairs, args.heads, args.head_dim)
        for mode in modes:
            if mode == "reference" and seq_len > args.reference_max_context:
                continue
            base = dict(workload="attention", mode=mode, world_size=1 if mode == "reference" else world,
                        context_len=seq_len, block_size=args.block_size, device=device_desc, date=today,
                        command=command, launch=command, schedule=args.schedule, regather=args.regather, pack_gqa=args.pack_gqa, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        dtype=str(dtype).removeprefix("torch."), check_rel_err=checks.get(mode), fresh_compile=True)  # fmt: skip
            try:
                fresh_point()  # no mode inherits another's compiled kernels (bench/isolation.py)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                built = _build(mode, seq_len, args, device)
                step_ms, exposed = float("nan"), None
                if built is not None:
                    fn, rq, rkv = built
                    q, k, v, g = _local_inputs(rq, rkv, args, device, dtype)
                    step_ms = _time_steps(fn, q, k, v, g, args.warmup, args.iters, device, barrier=mode != "reference")
                    if args.profile:  # every rank that holds the mode runs the step (collectives)
                        _profile_step(fn, q, k, v, g, f"{mode} L={seq_len}")
                    if mode in ("cp", "csbp") and world > 1:
                        with no_attention_communication():  # the same executor, collectives as local copies
                            no_comm_ms = _time_steps(fn, q, k, v, g, 1, args.iters, device)
                        exposed = max(step_ms - no_comm_ms, 0.0)
                    del q, k, v, g, built, fn
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
                step_ms = _max_over_ranks(0.0 if math.isnan(step_ms) else step_ms, device)  # ranks that run nothing: NaN
                peak = _max_over_ranks(peak, device)
                exposed = _max_over_ranks(exposed, device) if exposed is not None else None
                gpus = base["world_size"]
                rec = BenchRecord(**base, step_ms=step_ms, tokens_per_s=seq_len / (step_ms / 1e3),
                                  peak_mem_gib=peak, useful_tflops_per_gpu=flops / (step_ms / 1e3) / gpus / 1e12,
                                  exposed_comm_ms=exposed, visible_pairs=pairs)  # fmt: skip
            except torch.OutOfMemoryError:
                rec = BenchRecord(**base, status="oom")
            except Exception as err:  # record and continue with the next point
                rec = BenchRecord(**base, status="error", error=f"{type(err).__name__}: {err}"[:300])
            if dist.get_rank() == 0:
                records.append(rec)
                write_records(args.out, [rec])  # point by point: a killed run keeps what it measured
                print(f"{mode:>9} L={seq_len:>7} step={rec.step_ms or float('nan'):9.2f} ms "
                      f"tflops/gpu={rec.useful_tflops_per_gpu or float('nan'):7.1f} "
                      f"exposed={rec.exposed_comm_ms if rec.exposed_comm_ms is not None else float('nan'):7.2f} ms "
                      f"peak={rec.peak_mem_gib or float('nan'):6.1f} GiB {rec.status}", flush=True)  # fmt: skip
    return records


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        from specforge_csbp.distributed.launch import spawn

        args.contexts = "256,512"
        args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 16, 16
        args.check_context, args.warmup, args.iters = 128, 1, 2
        spawn(_smoke_rank, 2, args)
        return
    from specforge_csbp.distributed.launch import init_from_env

    init_from_env()
    records = run(args)
    if dist.get_rank() == 0:
        print(f"wrote {len(records)} records to {args.out}")
    dist.destroy_process_group()


def _smoke_rank(rank, world, args):
    run(args)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
