"""One drafter attention layer's FlexAttention call (forward + backward) per mode, compile state and kernel
option, on one GPU: why CSBP's call is slower than CP's over the same tiles.

    python benchmarks/flex_layer_bench.py --shape b --context 1M --anchors 512 \
        --variants cp:static,cp:dynamic,csbp:static,csbp:dynamic,csbp:dynamic+divisible

Each variant takes rank `--rank`'s plan of a P-rank step (`drafter_plans`, pure), builds the call the step
makes for layer type `--layer` (CP: local context shard ++ every block; CSBP fused: local ++ the other
ranks' shards ++ owned blocks) and times it on random bf16 tensors after `fresh_point()`:

    static             first call with these lengths: inductor sees constant shapes
    dynamic            a first call with 128 fewer query and key rows, then these lengths: automatic dynamic
                       shapes recompile the call site with symbolic lengths (what a training step gets once
                       the row counts change from step to step - every step for CSBP)
    +divisible         the library's `attention.flex.kernel_options`: both lengths are multiples of 128
                       (IS_DIVISIBLE) and, on CUDA, the forward's TMA loads (fwd_USE_TMA); without it this
                       script withholds them (its control: `kernel_options` replaced for the variant;
                       `+fwd_USE_TMA=0` turns the TMA loads off alone)
    +split             CSBP: two calls (local keys, the other ranks' keys) and an LSE merge, not one call
    +rev               the query rows in reverse order (heaviest query tiles dispatched first)
    +nopack / +pack    GQA head packing forced off / on (default: decided from the block masks)
    +executor          the layer's executor as the step runs it (CSBP: shard build, gather, concatenation;
                       CP: partial-output merge), communication replaced by local copies; needs torchrun
                       with --world-size ranks (each rank runs its own plan; on CPU: gloo, dense seam)
    +NAME=VALUE        a FlexAttention kernel option added to the call's (`fwd_`/`bwd_` prefixes select one
                       kernel: `+USE_TMA=1`, `+fwd_BLOCK_N=128+fwd_num_stages=2`, `+bwd_num_warps=4`)
    +autotune          the call site compiled with mode="max-autotune-no-cudagraphs" (inductor times its
                       config list and logs the choice)

Mode `bdlm` is a full block-diffusion LM's 2L call instead of a drafter layer's: one sequence of --context
clean tokens and its corrupted copy in blocks of --block-size, every row on one rank (`bdlm_plan`), heads
from --heads / --kv-heads / --head-dim (default: Qwen3-1.7B's), TFLOP/s from its visible pairs:

    python benchmarks/flex_layer_bench.py --context 64K --variants bdlm:static+divisible,bdlm:static+divisible+USE_TMA=1

Prints one line per variant (lengths, tiles visited, forward and forward + backward ms); diagnostics only,
no records. On CPU the same paths run at small sizes (forward only through eager FlexAttention;
tests/benchmarks/test_flex_layer_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafter_bench import SHAPES, parse_size, sequence  # noqa: E402
from nocomm import no_attention_communication  # noqa: E402

from specforge_csbp.attention import flex as flex_backend  # noqa: E402
from specforge_csbp.attention import merge_partials, partial_attention, prepare_attention  # noqa: E402
from specforge_csbp.attention.flex import block_mask_for, kernel_options, tile_visits  # noqa: E402
from specforge_csbp.bench.isolation import fresh_point  # noqa: E402
from specforge_csbp.layout.cost import attention_flops, bdlm_visible_pairs  # noqa: E402
from specforge_csbp.layout.plans import bdlm_plan  # noqa: E402
from specforge_csbp.layout import TokenSet  # noqa: E402
from specforge_csbp.masks import Visibility  # noqa: E402
from specforge_csbp.models.dflash import drafter_plans, make_dflash_config  # noqa: E402
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors  # noqa: E402
from specforge_csbp.planner.rates import timed  # noqa: E402  (median of reps after warm-up, synchronised)


def layer_visibility(mode: str, plan, kind: str, block_size: int, *, split=False, rev=False) -> list[Visibility]:
    """The visibilities of the seam calls a step makes for this layer type (ShardedAttention's, fused),
    or, `split`, of a local and a remote call."""
    lp = plan.layers[kind]
    queries = lp.shard.q_tokens
    if rev:
        queries = queries.select(torch.arange(len(queries) - 1, -1, -1))
    keys = [lp.shard.kv_tokens]
    if mode == "csbp" and lp.shard.communicates:
        keys = keys + [lp.shard.other_kv_tokens] if split else [TokenSet.cat([keys[0], lp.shard.other_kv_tokens])]
    return [Visibility(queries, k, block_size, window=lp.window, noisy_causal=lp.noisy_causal) for k in keys]


def trimmed(vis: Visibility, rows: int = 128) -> Visibility:
    """The same rule over `rows` fewer queries and keys (another shape for the same call site)."""
    return Visibility(
        vis.q.select(torch.arange(len(vis.q) - rows)), vis.k.select(torch.arange(len(vis.k) - rows)),
        vis.block_size, clean_within_block=vis.clean_within_block, window=vis.window, noisy_causal=vis.noisy_causal,
    )  # fmt: skip


def _tensor(shape, device, g, train):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(train)


def seam_step(parts: list[Visibility], heads, kv_heads, head_dim, device, pack=None, backward=True):
    """Forward + backward of the seam calls over `parts` (calls over the same queries, LSE-merged); forward
    only on CPU (FlexAttention has no CPU backward) or without `backward`."""
    g, train = torch.Generator(device=device).manual_seed(0), device.type == "cuda" and backward
    nq = len(parts[0].q)
    q = _tensor((1, heads, nq, head_dim), device, g, train)
    kv = [tuple(_tensor((1, kv_heads, len(vis.k), head_dim), device, g, train) for _ in "kv") for vis in parts]
    grad = torch.randn(1, heads, nq, head_dim, device=device, dtype=torch.bfloat16, generator=g)

    def step():
        out, lse = partial_attention(q, *kv[0], parts[0], backend="flex", pack_gqa=pack)
        for (k, v), vis in zip(kv[1:], parts[1:]):
            out, lse = merge_partials(out, lse, *partial_attention(q, k, v, vis, backend="flex", pack_gqa=pack))
        if train:
            out.backward(grad)

    return step


def executor_step(plan, kind: str, config, device):
    """Forward + backward of the layer's executor as the step runs it (`plan_attention`: CSBP's gather and
    concatenation, CP's partial-output merge), communication replaced by local copies."""
    from specforge_csbp.distributed.collectives import CommStats
    from specforge_csbp.models.dflash import plan_attention
    from specforge_csbp.parallel import AttentionOptions

    backend = "flex" if device.type == "cuda" else "dense"  # CPU: the dense seam (a smoke run of the path)
    options = AttentionOptions(backend=backend, stats=CommStats())
    attend = plan_attention(plan, group=dist.group.WORLD, options=options)
    lp, g = plan.layers[kind], torch.Generator(device=device).manual_seed(0)
    q = _tensor((1, config.num_attention_heads, lp.shard.q_rows.numel(), config.head_dim), device, g, True)
    k, v = (_tensor((1, config.num_key_value_heads, lp.shard.kv_rows.numel(), config.head_dim), device, g, True)
            for _ in "kv")  # fmt: skip
    grad = torch.randn(q.shape, device=device, dtype=torch.bfloat16, generator=g)

    def step():
        with no_attention_communication():
            out, _ = attend[kind].attend(q, k, v)
            out.backward(grad)

    return step


def profiled(step, device, title: str) -> None:
    """One profiled step: own device time by op (the copies around the kernel show here)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize(device)
    print(f"--- profile: {title}\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)


def parse_variant(variant: str) -> tuple[str, str, dict[str, object]]:
    """"mode:how+how+NAME=VALUE" -> (mode, how, kernel options); values are ints (1/0 for flags) or names."""
    mode, how = variant.split(":")
    extra: dict[str, object] = {}
    for part in how.split("+"):
        if "=" in part:
            name, value = part.split("=", 1)
            extra[name] = int(value) if value.lstrip("-").isdigit() else value
            if name.endswith("USE_TMA"):  # a flag
                extra[name] = bool(extra[name])
    return mode, how, extra


def bdlm_visibility(context: int, block_size: int) -> list[Visibility]:
    """The 2L call of a full BDLM on one rank: clean and corrupted rows of one sequence."""
    plan = bdlm_plan("csbp", context, block_size, 1)[0]
    return [Visibility(plan.q_tokens, plan.kv_tokens, block_size)]


def run_variant(variant, args, config, anchors, device, rank, compiled_flex) -> None:
    """Time one variant and print its line."""
    L, P, S = parse_size(args.context), args.world_size, config.draft_block_size
    mode, how, extra = parse_variant(variant)
    fresh_point()
    base = kernel_options if "divisible" in how else lambda q_len, kv_len, device=None: None
    flex_backend.kernel_options = lambda q_len, kv_len, device=None: (base(q_len, kv_len, device) or {}) | extra or None
    flex_backend._compiled_flex = compiled_flex
    if "autotune" in how and device.type == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        tuned = torch.compile(flex_attention, dynamic=None, mode="max-autotune-no-cudagraphs")
        flex_backend._compiled_flex = lambda: tuned
    flops = None
    if mode == "bdlm":
        parts = bdlm_visibility(L, args.block_size)
        dims = args.heads, args.kv_heads, args.head_dim, device
        groups = args.heads // args.kv_heads
        pairs = bdlm_visible_pairs(L, args.block_size)
        flops = attention_flops(pairs, args.heads, args.head_dim, backward=False), attention_flops(
            pairs, args.heads, args.head_dim
        )
    else:
        plan = drafter_plans(mode, L, anchors, config, P, bucket=args.bucket)[rank]
        parts = layer_visibility(mode, plan, args.layer, S, split="split" in how, rev="rev" in how)
        groups = config.num_attention_heads // config.num_key_value_heads
        dims = config.num_attention_heads, config.num_key_value_heads, config.head_dim, device
    force = True if "+pack" in how else False if "nopack" in how else None
    packs, tiles = [], 0
    for vis in parts:
        _, pack, target = prepare_attention(vis, groups=groups, device=device, backend="flex", pack_gqa=force)
        packs.append(pack)
        tiles += tile_visits(block_mask_for(target, device))
    if "dynamic" in how:  # compile the call site for other lengths first
        timed(seam_step([trimmed(vis) for vis in parts], *dims, pack=force), device, 1, warmup=1)
    step = executor_step(plan, args.layer, config, device) if "executor" in how else seam_step(
        parts, *dims, pack=force
    )
    ms = 1e3 * timed(step, device, args.iters, args.warmup)
    fwd_ms = None
    if "executor" not in how and device.type == "cuda":
        forward = seam_step(parts, *dims, pack=force, backward=False)
        with torch.no_grad():
            fwd_ms = 1e3 * timed(forward, device, args.iters, args.warmup)
    if args.profile and rank == 0 and device.type == "cuda":
        profiled(step, device, variant)
    keys = "+".join(str(len(vis.k)) for vis in parts)
    rate = ""
    if flops and fwd_ms:
        rate = f"  {flops[0] / fwd_ms / 1e9:6.1f} / {flops[1] / ms / 1e9:6.1f} TFLOP/s (fwd / fwd+bwd)"
    fwd = f"fwd {fwd_ms:8.2f} ms " if fwd_ms else ""
    print(f"{variant:30s} q {len(parts[0].q):7d} k {keys:>15s} pack_gqa {packs} tiles/kv-head {tiles:8d} "
          f"{fwd}fwd+bwd {ms:9.2f} ms{rate}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["a", "b"], default="b")
    p.add_argument("--context", default="1M")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the planned step")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--layer", choices=["full_attention", "sliding_attention"], default="full_attention")
    p.add_argument("--variants", default="cp:static,csbp:static,csbp:dynamic,csbp:dynamic+divisible")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket", type=int, default=4096, help="sliding-plan row padding, as drafter_bench's")
    p.add_argument("--profile", action="store_true", help="profile one step of each variant (rank 0)")
    p.add_argument("--block-size", type=int, default=32, help="mode bdlm: the BDLM's block size")
    p.add_argument("--heads", type=int, default=16, help="mode bdlm: query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="mode bdlm: key/value heads")
    p.add_argument("--head-dim", type=int, default=128, help="mode bdlm: head dimension")
    args = p.parse_args()

    shape = dict(SHAPES[args.shape])
    shape.pop("name")
    config = make_dflash_config(**shape)
    L, N, P, S = parse_size(args.context), args.anchors, args.world_size, config.draft_block_size
    _, mask = sequence(L, config, args.seed)
    objective = DFlashObjective(num_anchors=N, seed=args.seed, chunk_size=2048)
    anchors = sample_anchors(mask, objective, block_size=S, step=0, sample_index=0)
    # CPU runs the same path (compiled FlexAttention on CPU) at small sizes: a smoke test of this script
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":  # compiled CPU flex cannot return the LSE: the eager kernel, as the tests use
        from torch.nn.attention.flex_attention import flex_attention

        flex_backend._compiled_flex = lambda: flex_attention
    rank = args.rank
    if "executor" in args.variants:  # the executors need the process group they were planned for
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        rank = dist.get_rank()
        if dist.get_world_size() != P:
            raise SystemExit(f"--world-size {P} but launched with {dist.get_world_size()} ranks")
    print(f"shape {args.shape} L={L} N={N} P={P} rank {rank} layer {args.layer} torch {torch.__version__}")
    compiled_flex = flex_backend._compiled_flex
    for variant in args.variants.split(","):
        try:
            run_variant(variant, args, config, anchors, device, rank, compiled_flex)
        except Exception as e:  # a kernel config the device cannot run (e.g. out of shared memory): the next one
            if device.type != "cuda":
                raise
            print(f"{variant:30s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
