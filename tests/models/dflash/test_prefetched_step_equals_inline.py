"""models/dflash/prefetch.py: a step whose plans and attention masks were built ahead, in the worker thread,
computes exactly what a step that builds them itself computes, and builds no mask of its own; with a
FeatureLoad the worker also reads the context features (from a store-like callable) and the step none.

Two gloo ranks, float64; CSBP (two sequences, DFlash2, bucketed sliding plans, regather) and CP.
"""

import threading

import pytest
import torch
from tests.support.spawned import save_results, spawn_results
from tests.models.dflash.test_modes_equal_reference import Case, build

from specforge_csbp.masks.visibility import Visibility
from specforge_csbp.models.dflash import AttentionOptions, StepPrefetcher, drafter_step, prepare_step
from specforge_csbp.models.dflash.prefetch import FeatureLoad
from specforge_csbp.models.dflash.step import DrafterSample
from specforge_csbp.models.dflash.sharding import MergedAttention

CASES = [
    Case("csbp", True, (40, 29), 3, sampling="locality", block_size=3, window=5, bucket=5, seed=3, regather=True),
    Case("cp", False, (44,), 3, layer_types=("full_attention", "sliding_attention"), seed=4),
]


def _visibilities(attention):
    for layer in attention.values():
        sharded = layer.attend.local if isinstance(layer.attend, MergedAttention) else layer.attend
        yield from sharded.visibilities


def _caches(prepared):
    """Every mask cache of the prepared attention: (visibility id, key) -> id(value)."""
    out = {}
    for attention in prepared.attention:
        for vis in _visibilities(attention):
            packed = [e.vis for k, e in vis._cache.items() if k[0] == "gqa_packed"]
            for v in (vis, *packed):
                out.update({(id(v), repr(k)): id(val) for k, val in v._cache.items()})
    return out


class _MaskWork:
    """Counts, per thread, Visibility objects made and masks built (cache misses of `dense`)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        init, dense = Visibility.__init__, Visibility.dense

        def counted_init(vis, *args, **kwargs):
            self._count()
            init(vis, *args, **kwargs)

        def counted_dense(vis, device="cpu"):
            if ("dense", str(device)) not in vis._cache:
                self._count()
            return dense(vis, device)

        Visibility.__init__, Visibility.dense = counted_init, counted_dense

    def _count(self):
        name = threading.current_thread().name
        self.counts[name] = self.counts.get(name, 0) + 1


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    group = dist.group.WORLD
    mask_work = _MaskWork()
    results = []
    for case in CASES:
        model, head, embed, samples, obj = build(case)
        res = drafter_step(
            model, samples, objective=obj, mode=case.mode, head_weight=head, embed_weight=embed, step=1,
            bucket=case.bucket, group=group, options=AttentionOptions(regather=case.regather),
        )  # fmt: skip
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

        model2, head2, embed2, samples2, obj2 = build(case)
        cfg = model2.config
        builders = []

        def prepare(i, case=case, cfg=cfg, samples2=samples2, obj2=obj2, builders=builders):
            builders.append(threading.current_thread().name)
            return prepare_step(cfg, samples2, objective=obj2, mode=case.mode, step=i, group=group, bucket=case.bucket)

        options = AttentionOptions(regather=case.regather)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        with StepPrefetcher(prepare, options, device="cpu", groups=groups, group=group) as prefetcher:
            prepared = prefetcher.take(1)
            built = _caches(prepared)
            mask_work.counts.clear()
            res2 = drafter_step(
                model2, samples2, objective=obj2, mode=case.mode, head_weight=head2, embed_weight=embed2, step=1,
                bucket=case.bucket, group=group, options=AttentionOptions(regather=case.regather), prepared=prepared,
            )  # fmt: skip
            after = _caches(prepared)
            in_step = mask_work.counts.get(threading.current_thread().name, 0)
            wrong = None
            try:
                drafter_step(
                    model2, samples2, objective=obj2, mode=case.mode, head_weight=head2, embed_weight=embed2,
                    step=2, bucket=case.bucket, group=group, options=AttentionOptions(regather=not case.regather), prepared=prefetcher.take(2),
                )  # fmt: skip
            except ValueError as err:
                wrong = str(err)
        # features read ahead too: a store-like reader that notes the thread of every read
        model3, head3, embed3, samples3, obj3 = build(case)
        reads: list[str] = []

        def reader(features):
            def read(lo, hi):
                reads.append(threading.current_thread().name)
                return features[lo:hi].clone()

            return read

        samples3 = [DrafterSample(s.input_ids, s.loss_mask, reader(s.features)) for s in samples3]

        def prepare3(i, case=case, cfg=model3.config, samples3=samples3, obj3=obj3):
            return prepare_step(cfg, samples3, objective=obj3, mode=case.mode, step=i, group=group, bucket=case.bucket)

        load = FeatureLoad(model3.fc.weight.dtype, model3.fc.in_features)
        with StepPrefetcher(prepare3, options, device="cpu", groups=groups, group=group, features=load) as prefetcher:
            prepared3 = prefetcher.take(1)
            read_ahead = len(reads)
            res3 = drafter_step(
                model3, samples3, objective=obj3, mode=case.mode, head_weight=head3, embed_weight=embed3, step=1,
                bucket=case.bucket, group=group, options=AttentionOptions(regather=case.regather), prepared=prepared3,
            )  # fmt: skip
            reads_in_step = reads[read_ahead:].count(threading.current_thread().name)
        results.append({
            "features_loss_equal": res.loss == res3.loss,
            "features_grads_equal": all(torch.equal(grads[n], p.grad) for n, p in model3.named_parameters()),
            "features_read_ahead": read_ahead,
            "features_read_in_step": reads_in_step,
            "case": repr(case),
            "loss_equal": res.loss == res2.loss,
            "grads_equal": all(torch.equal(grads[n], p.grad) for n, p in model2.named_parameters()),
            "masks_built_ahead": len(built),
            "masks_built_in_step": len(set(after) - set(built)),
            "mask_work_in_step": in_step,
            "builders": sorted(set(builders)),
            "wrong_options_error": wrong,
        })  # fmt: skip
    if rank == 0:
        save_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, 2, tmp_path_factory.mktemp("dflash_prefetch"))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_prefetched_step_is_identical_and_builds_nothing(results, index):
    r = results[index]
    assert r["loss_equal"] and r["grads_equal"], r["case"]
    assert r["masks_built_ahead"] > 0 and r["masks_built_in_step"] == 0 and r["mask_work_in_step"] == 0, r
    assert all(name.startswith("csbp-prefetch") for name in r["builders"]), r["builders"]  # in the worker


@pytest.mark.parametrize("index", range(len(CASES)))
def test_features_loaded_ahead_give_the_same_step_and_no_read_in_it(results, index):
    r = results[index]
    assert r["features_loss_equal"] and r["features_grads_equal"], r["case"]
    assert r["features_read_ahead"] > 0 and r["features_read_in_step"] == 0, r


@pytest.mark.parametrize("index", range(len(CASES)))
def test_prepared_step_with_other_options_is_refused(results, index):
    err = results[index]["wrong_options_error"]
    assert err is not None and err.startswith("prepared: built with") and "regather" in err


def test_chunked_row_copy_covers_every_row_and_converts():
    """copy_rows_chunked (the pinned feature copy's loop, run here unpinned on the CPU): every row lands, in
    chunks of whole rows, for a chunk smaller than a row, uneven counts and a dtype change."""
    from specforge_csbp.models.dflash.features import copy_rows_chunked

    rows = torch.randn(37, 5, dtype=torch.float64)
    for chunk_bytes in (1, 40, 7 * 5 * 8, 10**9):
        out = torch.empty(37, 5, dtype=torch.float32)
        assert torch.equal(copy_rows_chunked(rows, out, chunk_bytes, pin=False), rows.float())
    empty = torch.empty(0, 5)
    assert copy_rows_chunked(empty, torch.empty(0, 5), 64, pin=False).shape == (0, 5)
