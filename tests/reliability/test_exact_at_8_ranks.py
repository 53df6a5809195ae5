"""Scale-out: the exactness checks of the core attention, the BDLM path and the DFlash drafter path pass
at 8 gloo ranks (float64, relative 1e-10), with uneven shapes: B = 9 and 13 blocks (P <= B < 2P,
B % P != 0), anchor counts not divisible by 8, GQA. One spawn of 8 ranks runs all three (process start
dominates), tiny shapes; marked slow (CI runs them too).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from specforge_csbp.parallel.check import CheckCase, run_check
from tests.support.checks import rel_err
from tests.support.spawned import save_results, spawn_results

P = 8
TOL = 1e-10
MODES = ("csbp", "cp", "bp")


# -- core attention: out, lse, dq, dk, dv ----------------------------------------------------------------------
def _attention_cases():
    for mode in MODES:
        for i, (L, S, heads, kv) in enumerate([(36, 4, 4, 2), (52, 4, 3, 3)]):  # B = 9 (P <= B < 2P), 13
            for rule in ("causal", "bidirectional"):
                yield CheckCase(mode, L, S, heads=heads, kv_heads=kv, head_dim=8, clean_within_block=rule,
                                batch=2, seed=i)  # fmt: skip


def _attention(rank: int) -> list[dict]:
    out = []
    for case in _attention_cases():
        r = run_check(case)
        if rank == 0:
            out.append({"case": repr(case), "errors": r.errors})
    return out


# -- BDLM: loss and every parameter gradient ----------------------------------------------------------------
BLOCK, BLOCKS, VOCAB, MASK = 4, 9, 64, 63


def _bdlm(kind: str, mode: str, group) -> tuple[float, dict[str, torch.Tensor]]:
    from specforge_csbp.models.bdlm import BDLMModel, BDLMWorkload
    from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS, float64_norms
    from specforge_csbp.objectives.convert import ConvertObjective
    from specforge_csbp.objectives.sft import SFTObjective
    from specforge_csbp.training.step import global_denominator, reduce_gradients

    L = BLOCK * BLOCKS
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, MASK, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[0, :5] = False  # a prompt

    def make():
        torch.manual_seed(0)
        model = BDLMModel.from_config(
            TINY_CONFIGS["qwen3"], dtype=torch.float64, block_size=BLOCK, backend="dense"
        )
        float64_norms(model.lm)
        return model

    objective = SFTObjective(BLOCK, MASK, VOCAB) if kind == "sft" else ConvertObjective(BLOCK, MASK, VOCAB)
    source = types.SimpleNamespace(get=lambda idx: (ids[list(idx)], mask[list(idx)]))
    workload = BDLMWorkload(make_model=make, objective=objective, source=source, seq_len=L)
    model = workload.build_model(types.SimpleNamespace(mode=mode, cp_group=group, attention_backend="dense", attention_schedule=None))
    batch = workload.microbatch([0, 1], [5, 6], torch.device("cpu"))
    denom = global_denominator([batch], group) if group is not None else torch.tensor(batch.denominator)
    numerator = workload.loss_numerator(model, batch)
    (numerator / denom).backward()
    params = dict(model.named_parameters())
    loss = numerator.detach().clone()
    if group is not None:
        reduce_gradients(list(params.values()), group)
        dist.all_reduce(loss, group=group)
    return float(loss / denom), {k: p.grad.detach().clone() for k, p in params.items()}


def _bdlm_all(rank: int) -> list[dict]:
    out = []
    for kind in ("sft", "convert"):
        ref = _bdlm(kind, "reference", None) if rank == 0 else None
        for mode in MODES:
            loss, grads = _bdlm(kind, mode, dist.group.WORLD)
            if rank == 0:
                errors = {
                    "loss": abs(loss - ref[0]) / ref[0],
                    **{n: rel_err(grads[n], g) for n, g in ref[1].items()},
                }
                zero = [n for n, g in ref[1].items() if not g.abs().max() > 0]
                out.append({"case": f"bdlm {kind} {mode}", "errors": errors, "zero": zero})
    return out


# -- DFlash / DFlash2 drafter: loss and every trainable gradient --------------------------------------------
def _drafter(dflash2: bool, mode: str, seq_len: int, anchors: int, group):
    from specforge_csbp.models.dflash import (
        DFlash2DraftModel,
        DFlashDraftModel,
        DrafterSample,
        drafter_step,
        make_dflash_config,
    )
    from specforge_csbp.objectives.dflash import DFlashObjective

    cfg = make_dflash_config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=61, num_target_layers=6, target_layer_ids=[1, 4], mask_token_id=60, block_size=4,
        layer_types=["sliding_attention", "full_attention"], sliding_window=9, dflash2=dflash2,
        conv_kernel_size=2, conv_group_size=8, selector_rank=5, selector_top_k=20,
    )  # fmt: skip
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(cfg).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every parameter random, so every path carries gradient
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if p.dim() == 1 else 0.0)
            )
    head = torch.randn(61, 32, generator=g, dtype=torch.float64) * 0.5
    embed = torch.randn(61, 32, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 60, (seq_len,), generator=g)
    mask = (torch.rand(seq_len, generator=g) > 0.15).double()
    mask[:2] = 0
    sample = DrafterSample(ids, mask, torch.randn(seq_len, 64, generator=g, dtype=torch.float64))
    objective = DFlashObjective(num_anchors=anchors, gamma=4.0, selector_alpha=0.7, seed=1)
    res = drafter_step(model, [sample], objective=objective, mode=mode, head_weight=head, embed_weight=embed,
                       step=1, group=group)  # fmt: skip
    return res.loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


DRAFTER_CASES = [(False, "csbp", 96, 2 * P + 1), (True, "csbp", 100, 3 * P - 1), (True, "cp", 88, P + 3)]


def _drafter_all(rank: int) -> list[dict]:
    out = []
    for dflash2, mode, seq_len, anchors in DRAFTER_CASES:
        loss, grads = _drafter(dflash2, mode, seq_len, anchors, dist.group.WORLD)
        if rank == 0:
            ref_loss, ref = _drafter(dflash2, "reference", seq_len, anchors, None)
            errors = {
                "loss": abs(loss - ref_loss) / abs(ref_loss),
                **{n: rel_err(grads[n], g) for n, g in ref.items()},
            }
            zero = [n for n, g in ref.items() if not g.abs().max() > 0]
            out.append({"case": f"drafter dflash2={dflash2} {mode} L={seq_len} N={anchors}", "errors": errors,
                        "zero": zero})  # fmt: skip
    return out


def _worker(rank, world, out):
    results = {"attention": _attention(rank), "bdlm": _bdlm_all(rank), "drafter": _drafter_all(rank)}
    if rank == 0:
        save_results(out, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, P, tmp_path_factory.mktemp("scale8"), timeout_s=300)


@pytest.mark.slow(reason="one spawn of 8 gloo ranks over every exactness check")
@pytest.mark.parametrize(
    "path, count",
    [("attention", len(list(_attention_cases()))), ("bdlm", 2 * len(MODES)), ("drafter", len(DRAFTER_CASES))],
)
def test_exact_at_8_ranks(results, path, count):
    assert len(results[path]) == count
    for res in results[path]:
        assert not res.get("zero"), f"{res['case']}: parameters without gradient {res['zero']}"
        for name, err in res["errors"].items():
            assert err <= TOL, f"{res['case']}: {name} max relative error {err:.3e}"
