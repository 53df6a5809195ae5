"""Drafter loss and every trainable gradient under CSBP, CP and DP equal the single-process reference.

float64 on gloo ranks, P = 2, 3, 4; DFlash and DFlash2; anchor counts not divisible by P; sliding-window and
full layers; GQA; D-PACE and decay losses; padded (bucketed) sliding plans; context K/V gathered one layer
ahead (fused and overlap schedules). One spawn of 4 gloo ranks runs the
whole case matrix on sub-groups of 2, 3 and 4 ranks (process start-up dominates CPU test time), and the first
rank of each group compares with the reference it computes itself.
"""

from dataclasses import dataclass

import pytest
import torch

from specforge_csbp.distributed.collectives import CommStats
from specforge_csbp.models.dflash import (
    AttentionOptions,
    DFlash2DraftModel,
    DFlashDraftModel,
    DrafterSample,
    drafter_step,
    make_dflash_config,
)
from specforge_csbp.objectives.dflash import DFlashObjective
from tests.support.checks import rel_err
from tests.support.spawned import save_results, spawn_results

TOL = 1e-10


@dataclass(frozen=True)
class Case:
    mode: str
    dflash2: bool
    seq_lens: tuple[int, ...]
    num_anchors: int
    block_size: int = 4
    loss_type: str = "dflash"
    sampling: str = "uniform"
    bucket: int = 1
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention")
    window: int = 9
    is_causal: bool | None = None
    seed: int = 0
    regather: bool = False  # CSBP: gathered context K/V freed after forward, gathered again in backward
    gather_ahead: bool = False  # CSBP: layer i + 1's context K/V gathered while layer i runs


def cases(world):
    P = world
    yield Case("csbp", False, (48,), 2 * P + 1, seed=1)
    yield Case("csbp", True, (52,), 3 * P - 1, loss_type="dpace", bucket=5, seed=2, regather=True)
    yield Case(
        "csbp", True, (40, 29), P + 1, sampling="locality", block_size=3, window=5, is_causal=False, seed=3
    )
    yield Case("cp", False, (44,), 2 * P - 1, layer_types=("full_attention", "sliding_attention"), seed=4)
    yield Case("cp", True, (36,), P + 2, loss_type="dpace-continuation-value-only", bucket=4, seed=5)
    yield Case("dp", True, tuple(30 + 3 * i for i in range(P + 1)), 5, seed=6)  # P <= B < 2P sequences
    # gather ahead: two layers of one type in a row (one executor, two gathers in flight), fused and overlap
    yield Case("csbp", True, (50,), 2 * P + 1, layer_types=("sliding_attention", "full_attention", "full_attention"),
               bucket=3, seed=7, gather_ahead=True)  # fmt: skip
    yield Case("csbp", False, (46, 33), P + 2, seed=8, regather=True, gather_ahead=True)
    yield Case("cp", True, (42,), 2 * P + 2, seed=10, gather_ahead=True)  # CP gathers no K/V: the switch is a no-op


def build(case: Case):
    cfg = make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=len(case.layer_types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=61, num_target_layers=6, target_layer_ids=[1, 4],
        mask_token_id=60, block_size=case.block_size, layer_types=list(case.layer_types),
        sliding_window=case.window, is_causal=case.is_causal, dflash2=case.dflash2, conv_kernel_size=2,
        conv_group_size=8, selector_rank=5, selector_top_k=20,
    )  # fmt: skip
    model = (DFlash2DraftModel if case.dflash2 else DFlashDraftModel)(cfg).double()
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():  # every parameter random, so every path carries gradient
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if p.dim() == 1 else 0.0)
            )
    head = torch.randn(61, 32, generator=g, dtype=torch.float64) * 0.5
    embed = torch.randn(61, 32, generator=g, dtype=torch.float64)
    samples = []
    for L in case.seq_lens:
        ids = torch.randint(0, 60, (L,), generator=g)
        mask = (torch.rand(L, generator=g) > 0.15).double()
        mask[:2] = 0
        feats = torch.randn(L, 64, generator=g, dtype=torch.float64)
        samples.append(DrafterSample(ids, mask, feats))
    obj = DFlashObjective(
        num_anchors=case.num_anchors, sampling=case.sampling, loss_type=case.loss_type, gamma=4.0,
        selector_alpha=0.7, selector_warmup_steps=3, seed=case.seed,
    )  # fmt: skip
    return model, head, embed, samples, obj


def run(case: Case, mode: str, stats=None, group=None):
    model, head, embed, samples, obj = build(case)
    res = drafter_step(
        model, samples, objective=obj, mode=mode, head_weight=head, embed_weight=embed, step=1,
        bucket=case.bucket, group=group,
        options=AttentionOptions(stats=stats or CommStats(), regather=case.regather, gather_ahead=case.gather_ahead),
    )  # fmt: skip
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return res, grads


def _recording_window_rows(seen: set):
    """sharding._window_rows, noting which branch each sliding plan took (whole shard kept / rows selected)."""
    from specforge_csbp.models.dflash import sharding

    original = sharding._window_rows

    def recorded(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.add("whole" if out[1] is None else "selected")
        return out

    sharding._window_rows = recorded


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    results = {}
    branches: set = set()
    _recording_window_rows(branches)
    for size in (2, 3, 4):
        group = dist.new_group(list(range(size)))  # collective over the world: every rank calls it
        if rank >= size:
            continue
        results[size] = []
        for case in cases(size):
            stats = CommStats()
            res, grads = run(case, case.mode, stats, group)
            if rank == 0:
                ref, ref_grads = run(case, "reference")
                errors = {"loss": abs(res.loss - ref.loss) / abs(ref.loss)}
                errors.update({n: rel_err(grads[n], ref_grads[n]) for n in ref_grads})
                zero = [n for n, g in ref_grads.items() if not g.abs().max() > 0]
                results[size].append({
                    "case": repr(case), "errors": errors, "zero_grads": zero,
                    "bytes": dict(stats.bytes_sent), "metrics": res.metrics, "ref_metrics": ref.metrics,
                })  # fmt: skip
    if rank == 0:
        results["window_rows"] = sorted(branches)
        save_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, 4, tmp_path_factory.mktemp("dflash_parallel"))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_mode_equals_the_reference(world, results):
    results = results[str(world)]
    assert len(results) == len(list(cases(world)))
    for res in results:
        assert not res["zero_grads"], f"{res['case']}: parameters without gradient {res['zero_grads']}"
        for name, err in res["errors"].items():
            assert err <= TOL, f"{res['case']}: {name} max relative error {err:.3e}"
        slots = [k for k in res["ref_metrics"] if k.startswith("slot_acc_")]  # slots 1 .. S-1
        assert len(slots) == eval(res["case"]).block_size - 1
        for key in ("acc", "supervised", "vocab_loss", "est_tau", *slots):  # est_tau: summed, exact too
            assert res["metrics"][key] == pytest.approx(res["ref_metrics"][key], rel=1e-10), (
                res["case"],
                key,
            )
        if "csbp" in res["case"] or "'cp'" in res["case"]:
            assert sum(res["bytes"].values()) > 0  # context K/V really travelled


def test_the_matrix_runs_sliding_layers_on_whole_shards_and_on_selected_rows(results):
    # sharding.WHOLE_SHARD_MAX_LEFT_OUT: both ways of feeding a sliding layer its context are held to the reference
    assert results["window_rows"] == ["selected", "whole"]
