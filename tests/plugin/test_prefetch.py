"""The plugin's training module (`plugin/training_model.py`) builds each gathered sample's plan and masks
in the prefetch worker, and what it trains equals the single-process reference.

Two gloo ranks, float64, CSBP P = 2, DFlash2: each rank brings one store sample, the CP group trains both.
sum(numerators) / sum(denominators) and the summed gradients must equal `drafter_step(mode="reference")`
over the same two samples (relative error <= 1e-10), and the second sample's masks must be built in the
prefetch worker (the first one's on the module's own thread: nothing announced it; across micro-steps see
tests/plugin/test_lookahead_across_steps.py). Both with `gather_ahead` on (the default) and off, which must reach
the attention the module builds.
"""

import os
import threading

import pytest
import torch

from specforge_csbp.data import FeatureStoreWriter, TargetInfo
from specforge_csbp.models.dflash import drafter_step
from tests.models.dflash.test_modes_equal_reference import Case, build
from tests.models.dflash.test_prefetched_step_equals_inline import _MaskWork
from tests.support.spawned import save_results, spawn_results

CASE = Case("csbp", True, (53, 40), 5, block_size=4, window=7, seed=11)
TOL = 1e-10


def _store(root, samples):
    with FeatureStoreWriter(root, target=TargetInfo(name="tiny"), target_layer_ids=[1, 4], hidden_size=32,
                            dtype="float64", chunk_bytes=8 * 64 * 8) as w:  # 8-row checksummed chunks  # fmt: skip
        for i, s in enumerate(samples):
            w.add(str(i), s.input_ids, s.loss_mask.long(), s.features)
    return root


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    from specforge_csbp.models.dflash import prefetch
    from specforge_csbp.models.dflash.sharding import plan_attention
    from specforge_csbp.parallel import AttentionOptions
    from specforge_csbp.plugin import groups as csbp_groups
    from specforge_csbp.plugin.training_model import CSBPDrafterTrainingModel

    model, head, embed, samples, obj = build(CASE)
    root = os.path.join(out_dir, "store")
    if rank == 0:
        _store(root, samples)
    dist.barrier()
    ref = drafter_step(model, samples, objective=obj, mode="reference", head_weight=head, embed_weight=embed,
                       step=1)  # fmt: skip
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    csbp_groups.init_groups(2)
    built_ahead = []  # per plan_attention call: does any layer gather one layer ahead?

    def spy(*args, **kwargs):
        attention = plan_attention(*args, **kwargs)
        built_ahead.append(any(layer.gather_ahead for layer in attention.values()))
        return attention

    prefetch.plan_attention = spy
    runs = {}
    for gather_ahead in (True, False):  # csbp.gather_ahead, default on (plugin/options.py)
        built_ahead.clear()
        draft, *_ = build(CASE)
        embed_mod = torch.nn.Embedding.from_pretrained(embed.clone(), freeze=True)
        head_mod = torch.nn.Linear(32, 61, bias=False, dtype=torch.float64)
        head_mod.weight.data.copy_(head)
        tm = CSBPDrafterTrainingModel(draft, embed_mod, head_mod, store_path=root, objective=obj, mode="csbp",
                                      max_len=1000, attention=AttentionOptions(backend="dense", gather_ahead=gather_ahead))  # fmt: skip
        mask_work = _MaskWork()
        numerator, denominator, _ = tm(sample_index=torch.tensor([rank]), global_step=1)
        in_forward = mask_work.counts.get(threading.current_thread().name, 0)
        in_worker = sum(n for name, n in mask_work.counts.items() if name.startswith("csbp-prefetch"))
        den = torch.tensor([float(denominator)], dtype=torch.float64)
        dist.all_reduce(den)
        loss = numerator / den
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        errors = {"loss": abs(float(total) - ref.loss) / abs(ref.loss)}
        for n, p in draft.named_parameters():
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            errors[n] = float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-300))
        files = sum(os.path.getsize(os.path.join(root, e.file)) for e in tm.store.manifest.samples[:2])
        runs[gather_ahead] = {"errors": errors, "in_forward": in_forward, "in_worker": in_worker,
                              "inflight": len(tm._jobs._held), "built_ahead": sorted(set(built_ahead)),
                              "store": {"read": tm.store.bytes_read, "hashed": tm.store.bytes_hashed, "files": files}}  # fmt: skip
    prefetch.plan_attention = plan_attention
    if rank == 0:
        save_results(out_dir, {str(k).lower(): v for k, v in runs.items()})
    csbp_groups.destroy()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, 2, tmp_path_factory.mktemp("plugin_prefetch"))


@pytest.mark.parametrize("gather_ahead", ["true", "false"])
def test_plugin_module_equals_the_reference(results, gather_ahead):
    for name, err in results[gather_ahead]["errors"].items():
        assert err <= TOL, f"{name}: max relative error {err:.3e}"


def test_plugin_module_passes_gather_ahead_to_its_attention(results):
    # CASE's drafter has layers whose CSBP plan gathers context K/V: on, they start it one layer early
    assert results["true"]["built_ahead"] == [True]
    assert results["false"]["built_ahead"] == [False]


@pytest.mark.parametrize("gather_ahead", ["true", "false"])
def test_plugin_module_builds_masks_in_the_worker_and_keeps_them(results, gather_ahead):
    # sample 0: nothing announced it (no look-ahead here), so the forward's own thread builds it; sample 1:
    # the worker, while sample 0 runs
    run = results[gather_ahead]
    assert run["in_worker"] > 0 and run["in_forward"] > 0, run
    assert run["inflight"] == 2  # both samples' masks held until the next micro-step


@pytest.mark.parametrize("gather_ahead", ["true", "false"])
def test_the_step_hashes_exactly_the_store_bytes_it_reads(results, gather_ahead):
    """The plugin's store (csbp.store_verify lazy): every byte the micro-step read was hashed, and a CSBP
    rank of 2 read about its half of the two samples, not their whole files."""
    store = results[gather_ahead]["store"]
    assert store["hashed"] == store["read"] > 0, store
    assert store["read"] < 0.8 * store["files"], store
