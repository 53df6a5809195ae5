"""Eval during training for the plugin's strategies: SpecForge 0.2.0's own TrainerController.evaluate (its
Evaluator) over `data.eval_hidden_states_path`, plus the strategy's `eval/est_tau` and `eval/slot_acc_k`
(plugin/reporting.py), is the same under CSBP as in one process and changes no training state.

    train store (4 samples)   eval store (6 samples, another seed)      DFlash2, float64, vocab 5 (so the
    reference: this process, no process group, CP size 1                 argmax is often right: est_tau > 1)
    CSBP P = 2 and P = 3 (gloo): SpecForge shards the eval refs over the ranks (6 divides by both: no padding
    duplicates), each CP group trains every gathered sample context-sharded; eval/* equal the reference
    to 1e-10, and before / after the pass: weights, torch RNG, the prefetch worker's jobs and the
    look-ahead state are unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch

from specforge_csbp.data import FeatureStoreWriter, TargetInfo
from specforge_csbp.models.dflash import DFlash2DraftModel, DrafterSample, make_dflash_config
from specforge_csbp.objectives.dflash import DFlashObjective
from tests.support.spawned import save_results, spawn_results

STRATEGY = "dflash2-csbp"
V, H = 5, 32
TOL = 1e-10


def _config():
    return make_dflash_config(
        hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=V, num_target_layers=6, target_layer_ids=[1, 4], mask_token_id=V - 1,
        block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=7, dflash2=True,
        conv_kernel_size=2, conv_group_size=8, selector_rank=3, selector_top_k=3,
    )  # fmt: skip


def _samples(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in lengths:
        mask = (torch.rand(L, generator=g) > 0.1).double()
        mask[:2] = 0
        ids = torch.randint(0, V - 1, (L,), generator=g)
        out.append(DrafterSample(ids, mask, torch.randn(L, 2 * H, generator=g, dtype=torch.float64)))
    return out


def _store(root, samples):
    with FeatureStoreWriter(root, target=TargetInfo(name="tiny"), target_layer_ids=[1, 4], hidden_size=H,
                            dtype="float64") as w:  # fmt: skip
        for i, s in enumerate(samples):
            w.add(str(i), s.input_ids, s.loss_mask.long(), s.features)


def make_stores(root):
    _store(os.path.join(root, "train"), _samples((41, 37, 50, 44), seed=1))
    _store(os.path.join(root, "eval"), _samples((45, 38, 52, 33, 47, 40), seed=2))


def _training_model(root):
    from specforge_csbp.parallel import AttentionOptions
    from specforge_csbp.plugin.training_model import CSBPDrafterTrainingModel

    torch.manual_seed(0)
    draft = DFlash2DraftModel(_config()).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random everywhere (published DFlash2 inits are identity / zero)
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    embed = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=g, dtype=torch.float64), freeze=True)
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    head.weight.data.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    objective = DFlashObjective(num_anchors=5, gamma=4.0, selector_alpha=0.7, seed=4)
    return CSBPDrafterTrainingModel(
        draft, embed, head, store_path=os.path.join(root, "train"), eval_store_path=os.path.join(root, "eval"),
        objective=objective, mode="csbp", max_len=1000, attention=AttentionOptions(backend="dense"),
    )  # fmt: skip


class _Backend:
    parallel_config = None


class _NeverBest:
    def is_better(self, metrics):
        return False


def evaluate(root, out_dir, rank=0, world=1):
    """One training micro-step (so the prefetch worker holds state), then one SpecForge eval pass; returns
    (eval metrics, what the pass changed)."""
    from types import SimpleNamespace

    from specforge.launch import _shard_offline_refs
    from specforge.runtime.data_plane import FeatureDataLoader, LocalFeatureStore
    from specforge.training.controller import TrainerController, TrainerCore

    from specforge_csbp.plugin import reporting
    from specforge_csbp.plugin.data import StoreIndexReader, build_collator, build_normalizer
    from specforge_csbp.plugin.strategy import CSBPDraftTrainStrategy

    tm = _training_model(root)
    strategy = CSBPDraftTrainStrategy(tm, name=STRATEGY)
    refs = StoreIndexReader(STRATEGY, os.path.join(root, "eval"), run_id="e", ttt_length=7, max_len=1000).read()

    def eval_data():  # what SpecForge's _make_offline_eval_data_factory builds
        shard = _shard_offline_refs(refs, use_usp_preprocess=False, shuffle=False, dp_rank=rank, dp_size=world)
        return FeatureDataLoader(LocalFeatureStore("e-eval"), refs=shard, batch_size=1, drop_last=False,
                                 collate_fn=build_collator(), per_sample_transform=build_normalizer(1000),
                                 strategy=STRATEGY)  # fmt: skip

    core = TrainerCore(strategy, _Backend())
    controller = TrainerController(core, run_id="e", output_dir=out_dir, eval_interval=1,
                                   eval_data_factory=eval_data, checkpoint_manager=_NeverBest())  # fmt: skip
    assert reporting.install(SimpleNamespace(trainer=SimpleNamespace(_controller=controller)))
    tm.train()
    numerator, _, _ = tm(sample_index=torch.tensor([rank]), global_step=2)
    numerator.backward()
    before = {
        "weights": [p.detach().clone() for p in tm.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in tm.parameters()],
        "rng": torch.get_rng_state(),
        "jobs": dict(tm._jobs._jobs), "outstanding": tm._jobs._outstanding, "stats": tm.prefetch_stats,
        "tokens": tm.tokens_trained,
    }  # fmt: skip
    controller.global_step = 2
    metrics = controller.evaluate_configured()
    changed = {
        "weights": not all(torch.equal(a, b) for a, b in zip(before["weights"], tm.parameters(), strict=True)),
        "grads": not all(
            (a is None and p.grad is None) or torch.equal(a, p.grad)
            for a, p in zip(before["grads"], tm.parameters(), strict=True)
        ),
        "rng": not torch.equal(before["rng"], torch.get_rng_state()),
        "prefetch": (before["jobs"], before["outstanding"], before["stats"])
        != (dict(tm._jobs._jobs), tm._jobs._outstanding, tm.prefetch_stats),
        "tokens": before["tokens"] != tm.tokens_trained,
        "training_mode": not tm.training,
    }
    tm.close()
    return metrics, changed


def _worker(rank, world, out_dir):
    from specforge_csbp.plugin import groups as csbp_groups

    csbp_groups.init_groups(world)  # one CP group: CSBP over every rank
    try:
        metrics, changed = evaluate(os.path.join(out_dir, "..", "stores"), out_dir, rank, world)
    finally:
        csbp_groups.destroy()
    if rank == 0:
        save_results(out_dir, {"metrics": metrics, "changed": changed})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("plugin_eval")
    make_stores(str(base / "stores"))
    reference = evaluate(str(base / "stores"), str(base / "ref"))
    out = {1: {"metrics": reference[0], "changed": reference[1]}}
    for world in (2, 3):
        (base / f"p{world}").mkdir()
        out[world] = spawn_results(_worker, world, base / f"p{world}")
    return out


def test_eval_reports_loss_accuracy_est_tau_and_slot_accuracy(runs):
    metrics = runs[1]["metrics"]
    assert {"eval/avg_loss", "eval/avg_acc", "eval/est_tau", "eval/slot_acc_1", "eval/slot_acc_3"} <= set(metrics)
    assert "eval/slot_acc_0" not in metrics and "eval/slot_acc_4" not in metrics  # slots 1 .. S-1
    assert metrics["eval/est_tau"] > 1.05  # vocab 5: leading runs of right guesses do occur
    assert 1.0 <= metrics["eval/est_tau"] <= 4.0 and 0.0 < metrics["eval/avg_acc"] < 1.0


@pytest.mark.parametrize("world", [2, 3])
def test_csbp_eval_equals_single_process_eval(runs, world):
    ref, got = runs[1]["metrics"], runs[world]["metrics"]
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=TOL, abs=1e-12), (world, key, got[key], value)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_changes_no_training_state(runs, world):
    assert runs[world]["changed"] == dict.fromkeys(runs[world]["changed"], False)
