"""plugin/groups.py on 4 gloo ranks: CP groups of 2 (cp fastest), DP groups across them, and each CP group's
gloo twin for host metadata (same ranks, gloo backend) that the training module exchanges sample indices on."""

import torch.distributed as dist

from specforge_csbp.plugin import groups as csbp_groups
from tests.support.spawned import save_results, spawn_results


def _worker(rank, world, out_dir):
    g = csbp_groups.init_groups(2)
    ranks = {
        name: dist.get_process_group_ranks(getattr(g, name)) for name in ("cp_group", "dp_group", "cp_host_group")
    }
    result = {"rank": rank, "ranks": ranks, "host_backend": dist.get_backend(g.cp_host_group),
              "cp_rank": g.cp_rank, "dp_rank": g.dp_rank}  # fmt: skip
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    csbp_groups.destroy()
    if rank == 0:
        save_results(out_dir, gathered)


def test_cp_groups_have_a_gloo_twin_over_the_same_ranks(tmp_path):
    for r in spawn_results(_worker, 4, tmp_path):
        cp = [0, 1] if r["rank"] < 2 else [2, 3]
        assert r["ranks"]["cp_group"] == cp and r["ranks"]["cp_host_group"] == cp, r
        assert r["ranks"]["dp_group"] == [r["rank"] % 2, r["rank"] % 2 + 2], r
        assert r["host_backend"] == "gloo" and (r["cp_rank"], r["dp_rank"]) == (r["rank"] % 2, r["rank"] // 2)
