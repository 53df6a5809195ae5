"""FlexAttention tile density of the DFlash drafter's attention, without and with GQA head packing (CPU).

    python scripts/tile_density.py                        # 128K x {512, 2048} anchors (~15 s, 2 cores)
    python scripts/tile_density.py --contexts 128K,512K,1M --anchors 512,2048 --max-rows-x-context 0  # ~1 min
    python scripts/tile_density.py --smoke                # tiny shapes, seconds

For every rank and layer kind of the csbp and cp plans (P = 2, block 16, bucket 4096, H = 32, Kh = 8,
the drafter_bench shape-a config, anchors sampled as the benchmark does with seed 0), it
prints the visible (query, key) pairs per head, the 128x128 tiles the kernel visits times the heads it runs
(H unpacked, Kh packed: a packed tile holds 32 rows x 4 heads), the density pairs x H / (tiles x heads x
128 x 128), and whether the automatic rule (`attention.packing.should_pack`) packs. csbp rows add the local
and the gathered-keys calls. Both block masks come from one pass of the rule over 32-row chunks
(`packing.tile_counts`, counted per kv tile by binary search): seconds per point on 2 cores (512K x 512: 6 s,
1M x 512: 10 s); points above --max-rows-x-context are skipped unless it is raised.
"""

from __future__ import annotations

import argparse
import time

import torch

from specforge_csbp.attention.packing import TILE, should_pack, tile_counts
from specforge_csbp.masks import Visibility
from specforge_csbp.models.dflash import drafter_plans, make_dflash_config
from specforge_csbp.objectives.dflash import DFlashObjective, sample_anchors
from specforge_csbp.planner.pairs import count_visible
from specforge_csbp.values import parse_sizes


def _calls(shard, block_size: int, window, noisy_causal: bool):
    rule = {"window": window, "noisy_causal": noisy_causal}
    yield Visibility(shard.q_tokens, shard.kv_tokens, block_size, **rule)
    if shard.communicates:
        yield Visibility(shard.q_tokens, shard.remote_kv_tokens, block_size, **rule)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="128K", help="comma list of context lengths (K/M suffixes)")
    p.add_argument("--anchors", default="512,2048", help="comma list of anchor counts")
    p.add_argument(
        "--max-rows-x-context",
        type=float,
        default=5e9,
        help="skip points whose anchors*block*context exceeds this (CPU time); 0 = no limit",
    )
    p.add_argument("--modes", default="csbp,cp")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--bucket", type=int, default=4096)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (8K context, 64 anchors, window 512)")
    a = p.parse_args()
    if a.smoke:
        a.contexts, a.anchors, a.window, a.bucket = "8K", "64", 512, 256
    if a.heads % a.kv_heads:
        raise ValueError(f"heads ({a.heads}) must be a multiple of kv_heads ({a.kv_heads})")
    S, P, H, Kh = a.block_size, a.world_size, a.heads, a.kv_heads
    G = H // Kh
    # benchmarks/drafter_bench.py shape "a" (qwen3.6-27b drafter): the csbp anchor ownership follows its costs
    cfg = make_dflash_config(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=H,
        num_key_value_heads=Kh, head_dim=128, vocab_size=248320, num_target_layers=64,
        target_layer_ids=[5, 19, 33, 47, 61], mask_token_id=248070, block_size=S,
        layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=a.window,
    )  # fmt: skip
    cpu = torch.device("cpu")
    head = (f"{'L':>5} {'anch':>5} {'mode':<5} {'rk':>2} {'layer':<8} {'q_rows':>6} {'pairs/head':>13} "
            f"{'tiles*H':>10} {'packed*Kh':>10} {'ratio':>6} {'dens':>6} {'dens_p':>6} auto")  # fmt: skip
    print(f"H={H} Kh={Kh} G={G} S={S} P={P} window={a.window} bucket={a.bucket} tile={TILE}")
    print(head)
    print("-" * len(head))
    for L in parse_sizes(a.contexts, field="--contexts"):
        for n in map(int, a.anchors.split(",")):
            if a.max_rows_x_context and n * S * L > a.max_rows_x_context:
                print(f"{L // 1024:>4}K {n:>5} skipped: anchors*block*context = {n * S * L:.1e} > "
                      f"--max-rows-x-context {a.max_rows_x_context:.0e} (CPU time)")  # fmt: skip
                continue
            t0 = time.time()
            anchors = sample_anchors(torch.ones(L), DFlashObjective(num_anchors=n), block_size=S)
            for mode in a.modes.split(","):
                for r, plan in enumerate(drafter_plans(mode, L, anchors, cfg, P, bucket=a.bucket)):
                    for kind, lp in plan.layers.items():
                        pairs = tiles = packed = 0
                        auto = []
                        for vis in _calls(lp.shard, S, lp.window, lp.noisy_causal):
                            pairs += count_visible(
                                vis.q, vis.k, S, window=vis.window, noisy_causal=vis.noisy_causal
                            )
                            counts = tile_counts(vis, G, cpu)
                            tiles, packed = tiles + H * counts.unpacked, packed + Kh * counts.packed
                            auto.append("pack" if should_pack(vis, G, cpu) else "no")
                        cells = TILE * TILE
                        print(
                            f"{L // 1024:>4}K {n:>5} {mode:<5} {r:>2} {kind.split('_')[0]:<8} "
                            f"{len(lp.shard.q_tokens):>6} {pairs:>13,} {tiles:>10,} {packed:>10,} "
                            f"{packed / tiles:>6.2f} {pairs * H / (tiles * cells):>6.1%} "
                            f"{pairs * H / (packed * cells):>6.1%} {'/'.join(auto)}",
                            flush=True,
                        )  # fmt: skip
            print(f"# {L // 1024}K x {n} anchors: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
