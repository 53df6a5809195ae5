"""Per-rank FlexAttention work of one BDLM attention layer, per mode, computed on CPU from the plans.

    python scripts/tile_counts.py --seq-len 16384 --block-size 64 --world-size 2

Prints, per rank, the 128x128 tiles the kernels visit (partial + full) and the visible pairs, for the local
and the remote (gathered) call of cp/csbp and for PyTorch's context parallel (head-tail over the 2L
sequence, one call). Equal totals mean any speed difference between modes is kernel efficiency, not work.
"""

from __future__ import annotations

import argparse

import torch

from specforge_csbp.attention.flex import block_mask_for
from specforge_csbp.layout import bdlm_plan
from specforge_csbp.masks import Visibility


def tiles(vis: Visibility) -> tuple[int, int]:
    bm = block_mask_for(vis, torch.device("cpu"))
    return int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args()
    L, S, P = a.seq_len, a.block_size, a.world_size
    print("mode      rank  tiles(total)  partial  local  remote")
    for mode in ("csbp", "cp", "bp"):
        for r, pl in enumerate(bdlm_plan(mode, L, S, P)):
            loc = tiles(Visibility(pl.q_tokens, pl.kv_tokens, S))
            rem = tiles(Visibility(pl.q_tokens, pl.remote_kv_tokens, S)) if pl.communicates else (0, 0)
            print(f"{mode:<9} {r:>4}  {loc[0] + rem[0]:>12}  {loc[1] + rem[1]:>7}  {loc[0]:>5}  {rem[0]:>6}")
    ref = bdlm_plan("reference", L, S, 1)[0]
    n, k = 2 * L, 2 * L // (2 * P)
    for r in range(P):
        rows = torch.cat([torch.arange(r * k, (r + 1) * k), torch.arange(n - (r + 1) * k, n - r * k)])
        t = tiles(Visibility(ref.q_tokens.select(rows), ref.kv_tokens, S))
        print(f"{'torch-cp':<9} {r:>4}  {t[0]:>12}  {t[1]:>7}  {t[0]:>5}  {0:>6}")


if __name__ == "__main__":
    main()
