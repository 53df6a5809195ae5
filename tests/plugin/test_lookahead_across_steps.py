"""`specforge train --csbp` builds the NEXT micro-step's first sample while the current one runs
(plugin/lookahead.py + plugin/training_model.py), and what it trains does not change.

Two gloo ranks (one CP group, CSBP P = 2), float64, DFlash2, through SpecForge 0.2.0's own data path and
step loop: StoreIndexReader refs sharded like SpecForge's DistributedSampler (shuffled per epoch),
FeatureDataLoader with the plugin's normalizer / collator, CSBPDraftTrainStrategy, TrainerCore
(accumulation 2) and TrainerController.fit over 2 epochs of 3 micro-steps (6 micro-steps, 3 optimizer steps;
an optimizer step closes inside each epoch and one window spans the epoch boundary). Only the FSDP backend is
a stub (backward, gradient scaling, a snapshot of the gradients at each optimizer step).

    run "plain"    no look-ahead installed (today's behaviour)
    run "ahead"    LookAheadLoader over the loader: losses, gradients, batches and steps bit-identical to
                   "plain"; micro-steps 2, 3, 5, 6 build no mask on the forward's own thread (1 is the first,
                   4 the first of an epoch: nothing announces them)
    run "wrong"    the look-ahead lies once about the sample (before micro-step 2) and once about the step
                   (before micro-step 5): both detected - the wrong build is made in the worker, dropped, and
                   the right one built on the forward's own thread - and everything still equals "plain"
    run "resume"   SpecForge resumes mid-epoch 0 (seek through the wrapper): the same batches and steps as
                   "plain"'s micro-steps 3 .. 6, and the look-ahead works after the resume
    run "evals"    SpecForge's evaluation after every optimizer step (eval forwards in between): training
                   bit-identical to "plain"; eval forwards build on their own and leave the announced build
                   alone (the same builds are used as in "ahead")
    run "resume_evals"  "resume" with SpecForge's evaluation after every optimizer step: identical to "resume"
"""

import os
import threading

import pytest
import torch

from tests.models.dflash.test_modes_equal_reference import Case, build
from tests.models.dflash.test_prefetched_step_equals_inline import _MaskWork
from tests.plugin.test_prefetch import _store
from tests.support.spawned import save_results, spawn_results

CASE = Case("csbp", True, (53, 40, 47, 36, 58, 44), 5, block_size=4, window=7, seed=13)
STRATEGY = "dflash2-csbp"
ACCUMULATION, EPOCHS = 2, 2
MAIN = "MainThread"
READS: dict[str, int] = {}  # feature-store interval reads per thread (patched in the worker)


def _count_store_reads() -> None:
    from specforge_csbp.data.store import FeatureStore

    read = FeatureStore.read_intervals

    def counted(store, *args, **kwargs):
        name = threading.current_thread().name
        READS[name] = READS.get(name, 0) + 1
        return read(store, *args, **kwargs)

    FeatureStore.read_intervals = counted


class _Backend:
    """The part of SpecForge's FSDPTrainingBackend TrainerCore calls (no sharding, no optimizer)."""

    parallel_config = None

    def __init__(self, params):
        self.params, self.losses, self.grads = params, [], []

    def backward(self, loss, is_boundary):
        self.losses.append(float(loss.detach()))
        loss.backward()

    def scale_gradients(self, scale):
        for p in self.params:
            p.grad.mul_(scale)

    def step(self):
        self.grads.append([p.grad.detach().clone() for p in self.params])
        for p in self.params:
            p.grad = None  # grad_norm: None


class _NeverBest:
    """Checkpoint manager of a run that evaluates but saves nothing (no real backend here)."""

    def is_better(self, metrics):
        return False


def _run(name, root, out_dir, rank, masks, *, look_ahead, lie=None, start=None, evaluate=False):
    """One training run through SpecForge's loop; returns its record (per micro-step: local sample index,
    global step, masks built on the forward's own thread; every `_prepare`: on the forward's thread?, sample,
    step) and its backend (losses, gradients). `masks` counts mask work per thread."""
    import torch.distributed as dist
    from specforge.launch import _shard_offline_refs
    from specforge.runtime.data_plane import FeatureDataLoader, LocalFeatureStore
    from specforge.training.controller import TrainerController, TrainerCore

    from specforge_csbp.parallel import AttentionOptions
    from specforge_csbp.plugin import lookahead
    from specforge_csbp.plugin.data import StoreIndexReader, build_collator, build_normalizer
    from specforge_csbp.plugin.strategy import CSBPDraftTrainStrategy
    from specforge_csbp.plugin.training_model import CSBPDrafterTrainingModel

    draft, head, embed, _, obj = build(CASE)
    embed_mod = torch.nn.Embedding.from_pretrained(embed.clone(), freeze=True)
    head_mod = torch.nn.Linear(32, 61, bias=False, dtype=torch.float64)
    head_mod.weight.data.copy_(head)
    tm = CSBPDrafterTrainingModel(draft, embed_mod, head_mod, store_path=root, objective=obj, mode="csbp",
                                  max_len=1000, attention=AttentionOptions(backend="dense"))  # fmt: skip
    refs = StoreIndexReader(STRATEGY, root, run_id=name, ttt_length=7, max_len=1000).read()
    loader = FeatureDataLoader(LocalFeatureStore(name), refs=refs, batch_size=1, collate_fn=build_collator(),
                               per_sample_transform=build_normalizer(1000), drop_last=True, strategy=STRATEGY)  # fmt: skip

    def set_epoch(epoch):  # what SpecForge's Trainer installs: the epoch's shuffled share of this rank
        loader._refs = _shard_offline_refs(refs, use_usp_preprocess=False, seed=0, epoch=epoch, dp_rank=rank,
                                           dp_size=dist.get_world_size())  # fmt: skip
        loader._seek_batches = 0

    loader.set_epoch = set_epoch
    params = [p for p in draft.parameters() if p.requires_grad]
    backend = _Backend(params)
    core = TrainerCore(CSBPDraftTrainStrategy(tm, name=STRATEGY), backend, accumulation_steps=ACCUMULATION)
    data = loader
    lookahead.uninstall()
    if look_ahead:
        data = lookahead.wrap(loader, core)
        if lie is not None:
            told, honest = [], data.next_batch

            def lying(step):  # the n-th announcement (n = micro-step it is made in) replaced by a wrong one
                got = honest(step)
                told.append(got)
                return got if got is None else lie(len(told), *got)

            data.next_batch = lying
    record = {"index": [], "step": [], "own_masks": [], "own_reads": [], "prepared": [], "eval_forwards": 0,
              "ahead_sizes": []}  # fmt: skip
    forward, prepare, ahead_of = tm.forward, tm._prepare, tm._ahead

    def logged_ahead(indices):  # the samples each look-ahead builds in one job
        got = ahead_of(indices)
        record["ahead_sizes"].append(len(got))
        return got

    def counted_forward(sample_index, global_step=0):
        if not tm.training:
            record["eval_forwards"] += 1
            return forward(sample_index=sample_index, global_step=global_step)
        before, reads_before = masks.counts.get(MAIN, 0), READS.get(MAIN, 0)
        out = forward(sample_index=sample_index, global_step=global_step)
        record["own_reads"].append(READS.get(MAIN, 0) - reads_before)
        record["index"].append(int(torch.as_tensor(sample_index).reshape(-1)[0]))
        record["step"].append(int(global_step))
        record["own_masks"].append(masks.counts.get(MAIN, 0) - before)
        return out

    def logged_prepare(index, step, groups, **kwargs):
        if tm.training:  # eval forwards prepare on their own (training_model._eval_forward)
            record["prepared"].append([threading.current_thread().name == MAIN, int(index), int(step)])
        return prepare(index, step, groups, **kwargs)

    tm.forward, tm._prepare, tm._ahead = counted_forward, logged_prepare, logged_ahead
    position, world = start or {}, dist.get_world_size()

    def eval_data():  # SpecForge's eval loader: this rank's share, unshuffled, the last batch kept
        shard = _shard_offline_refs(
            refs, use_usp_preprocess=False, shuffle=False, dp_rank=rank, dp_size=world
        )
        return FeatureDataLoader(LocalFeatureStore(name + "-eval"), refs=shard, batch_size=1, drop_last=False,
                                 collate_fn=build_collator(), per_sample_transform=build_normalizer(1000),
                                 strategy=STRATEGY)  # fmt: skip

    controller = TrainerController(core, run_id=name, output_dir=os.path.join(out_dir, name), num_epochs=EPOCHS,
                                   start_step=position.get("step", 0), start_batch=position.get("batch", 0),
                                   start_samples=position.get("batch", 0), log_interval=1000,
                                   eval_interval=1 if evaluate else 0, eval_data_factory=eval_data if evaluate else None,
                                   checkpoint_manager=_NeverBest())  # fmt: skip
    try:
        record["final_step"] = controller.fit(data)
    finally:
        tm.close()
        lookahead.uninstall()
    record["stats"] = dict(tm.prefetch_stats)
    return record, backend


def _identical(a, b):
    return a.losses == b.losses and all(
        torch.equal(x, y)
        for ga, gb in zip(a.grads, b.grads, strict=True)
        for x, y in zip(ga, gb, strict=True)
    )


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    from specforge_csbp.plugin import groups as csbp_groups

    root = os.path.join(out_dir, "store")
    if rank == 0:
        _store(root, build(CASE)[3])
    dist.barrier()
    csbp_groups.init_groups(2)
    masks = _MaskWork()
    _count_store_reads()
    plain, plain_backend = _run("plain", root, out_dir, rank, masks, look_ahead=False)
    ahead, ahead_backend = _run("ahead", root, out_dir, rank, masks, look_ahead=True)
    others = [i for i in range(len(CASE.seq_lens)) if i not in plain["index"][:2]]

    def lie(n, index, step):  # before micro-step 2: another sample; before micro-step 5: the wrong step
        if n == 1:
            return torch.full_like(index, others[0]), step
        return (index, step + 1) if n == 4 else (index, step)

    from specforge_csbp.plugin import training_model

    budget = training_model.AHEAD_TOKENS
    training_model.AHEAD_TOKENS = 1  # a look-ahead of the first sample only
    try:
        partial, partial_backend = _run("partial", root, out_dir, rank, masks, look_ahead=True)
    finally:
        training_model.AHEAD_TOKENS = budget
    wrong, wrong_backend = _run("wrong", root, out_dir, rank, masks, look_ahead=True, lie=lie)
    resume, resume_backend = _run("resume", root, out_dir, rank, masks, look_ahead=True, start={"step": 1, "batch": 2})
    evals, evals_backend = _run("evals", root, out_dir, rank, masks, look_ahead=True, evaluate=True)
    resume_evals, resume_evals_backend = _run("resume_evals", root, out_dir, rank, masks, look_ahead=True,
                                              start={"step": 1, "batch": 2}, evaluate=True)  # fmt: skip
    identical = [_identical(plain_backend, b) for b in (ahead_backend, wrong_backend, evals_backend)]
    identical.append(_identical(resume_backend, resume_evals_backend))
    identical.append(_identical(plain_backend, partial_backend))
    flags = [None] * world  # [[ahead, wrong, evals] of rank 0, of rank 1]
    dist.all_gather_object(flags, identical)
    results = {
        "plain": plain, "ahead": ahead, "wrong": wrong, "resume": resume, "evals": evals, "lie_index": others[0],
        "ahead_identical": [f[0] for f in flags], "wrong_identical": [f[1] for f in flags],
        "evals_identical": [f[2] for f in flags], "resume_evals": resume_evals,
        "resume_evals_identical": [f[3] for f in flags], "partial": partial,
        "partial_identical": [f[4] for f in flags],
        "optimizer_steps": len(plain_backend.grads), "losses": len(plain_backend.losses),
    }  # fmt: skip
    if rank == 0:
        save_results(out_dir, results)
    csbp_groups.destroy()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, 2, tmp_path_factory.mktemp("plugin_prefetch_across_steps"))


def test_runs_cover_epochs_and_accumulation(results):
    plain = results["plain"]
    assert results["losses"] == 6 and results["optimizer_steps"] == 3 and plain["final_step"] == 3
    assert plain["step"] == [0, 0, 1, 1, 2, 2]
    assert plain["own_masks"][0] > 0 and plain["stats"] == {"ahead_used": 0, "ahead_discarded": 0}


def test_look_ahead_trains_the_same_batches_bit_identically(results):
    plain, ahead = results["plain"], results["ahead"]
    assert (ahead["index"], ahead["step"]) == (plain["index"], plain["step"])
    assert results["ahead_identical"] == [True, True]  # losses and gradients of both ranks


def test_later_micro_steps_build_no_mask_on_their_own_thread(results):
    own = results["ahead"]["own_masks"]
    assert own[0] > 0 and own[3] > 0, own  # the first micro-step, and the first of epoch 1: not announced
    assert [own[i] for i in (1, 2, 4, 5)] == [0, 0, 0, 0], own
    # csbp.prefetch_features (default): the worker read those micro-steps' features from the store too
    reads = results["ahead"]["own_reads"]
    assert reads[0] > 0 and [reads[i] for i in (1, 2, 4, 5)] == [0, 0, 0, 0], reads
    assert results["ahead"]["stats"] == {"ahead_used": 4, "ahead_discarded": 0}


def test_the_look_ahead_builds_the_whole_next_batch_or_its_first_samples(results):
    """Both samples of a micro-step (one per rank) fit AHEAD_TOKENS: the look-ahead builds them in one job;
    with a budget of one token it builds the first only and the second is built while the first runs (the
    long-sample layout). Both train bit-identically and build nothing on the forward's thread."""
    ahead, partial, plain = results["ahead"], results["partial"], results["plain"]
    assert ahead["ahead_sizes"] and set(ahead["ahead_sizes"]) == {2}
    assert partial["ahead_sizes"] and set(partial["ahead_sizes"]) == {1}
    assert (partial["index"], partial["step"]) == (plain["index"], plain["step"])
    assert results["partial_identical"] == [True, True]
    assert [partial["own_masks"][i] for i in (1, 2, 4, 5)] == [0, 0, 0, 0], partial["own_masks"]
    assert partial["stats"] == {"ahead_used": 4, "ahead_discarded": 0}


def test_a_wrong_look_ahead_is_detected_and_rebuilt(results):
    plain, wrong = results["plain"], results["wrong"]
    assert (wrong["index"], wrong["step"]) == (plain["index"], plain["step"])
    assert results["wrong_identical"] == [True, True]
    assert wrong["stats"] == {"ahead_used": 2, "ahead_discarded": 2}
    own = wrong["own_masks"]
    assert [own[i] > 0 for i in range(6)] == [True, True, False, True, True, False], own
    prepared = wrong["prepared"]
    first2, first5 = [plain["index"][1], plain["step"][1]], [plain["index"][4], plain["step"][4]]
    told2, told5 = [results["lie_index"], plain["step"][1]], [plain["index"][4], plain["step"][4] + 1]
    assert [False, *told2] in prepared and [False, *told5] in prepared  # the lies were built, in the worker
    assert prepared.index([False, *told2]) < prepared.index([True, *first2])  # then dropped and rebuilt here
    assert prepared.index([False, *told5]) < prepared.index([True, *first5])


def test_resume_mid_epoch_through_the_look_ahead(results):
    plain, resume = results["plain"], results["resume"]
    assert (resume["index"], resume["step"]) == (plain["index"][2:], plain["step"][2:])
    assert resume["final_step"] == 3
    assert resume["own_masks"][0] > 0 and resume["own_masks"][1] > 0  # first of the run, first of epoch 1
    assert resume["own_masks"][2:] == [0, 0] and resume["stats"]["ahead_used"] == 2


def test_eval_forwards_between_steps_change_nothing(results):
    plain, evals = results["plain"], results["evals"]
    assert evals["eval_forwards"] == 9  # 3 batches after each of the 3 optimizer steps
    assert (evals["index"], evals["step"]) == (plain["index"], plain["step"])
    assert results["evals_identical"] == [True, True]
    # an eval forward leaves the announced build alone: every announced micro-step still uses its build
    assert evals["own_masks"] == [n for n in results["ahead"]["own_masks"]], evals["own_masks"]
    assert [n > 0 for n in evals["own_masks"]] == [True, False, False, True, False, False], evals["own_masks"]
    assert evals["stats"] == {"ahead_used": 4, "ahead_discarded": 0}


def test_a_resumed_run_is_unchanged_by_eval(results):
    """Resumed mid-epoch 0, with SpecForge's eval after every optimizer step: the same batches, steps, losses
    and gradients as the same resume without eval."""
    resume, evals = results["resume"], results["resume_evals"]
    assert (evals["index"], evals["step"]) == (resume["index"], resume["step"])
    assert evals["eval_forwards"] == 6  # 3 batches after each of the resumed run's 2 optimizer steps
    assert results["resume_evals_identical"] == [True, True]


class _Batch:
    def __init__(self, index):
        self.tensors = {"sample_index": torch.tensor([index])}


class _Loader:
    """Batches 0 .. n-1 (a failure instead of batch `fail_at`), with SpecForge's seek / set_epoch names."""

    queue = None

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at, self.skip, self.epoch = n, fail_at, 0, None

    def seek(self, batches):
        self.skip = batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for i in range(skip, self.n):
            if i == self.fail_at:
                raise OSError(f"batch {i} unreadable")
            yield _Batch(i)


class _Core:
    def __init__(self, remainder, steps):
        self.accumulation_remainder, self.accumulation_steps = remainder, steps


def test_look_ahead_loader_yields_the_same_batches_and_announces_the_next():
    from types import SimpleNamespace

    from specforge_csbp.plugin import lookahead

    inner, core = _Loader(4), _Core(0, 2)
    run = SimpleNamespace(trainer=SimpleNamespace(_loader=inner, core=core, max_steps=9))
    wrapped = lookahead.install(run)
    try:
        assert run.trainer._loader is wrapped and lookahead.current() is wrapped
        wrapped.set_epoch(3)
        wrapped.seek(1)  # SpecForge's resume position: forwarded
        assert inner.epoch == 3 and inner.skip == 1
        seen, announced = [], []
        for batch in wrapped:
            seen.append(int(batch.tensors["sample_index"]))
            got = wrapped.next_batch(7)
            announced.append(None if got is None else (int(got[0]), got[1]))
        assert seen == [1, 2, 3]
        assert announced == [(2, 7), (3, 7), None]  # remainder 0 of 2: the window stays open, same step
        assert wrapped.next_batch(7) is None  # between epochs: unknown
        core.accumulation_remainder = 1  # this micro-step closes the window: the next runs at step + 1
        it = iter(wrapped)
        next(it)
        assert wrapped.next_batch(7)[1] == 8
        assert wrapped.next_batch(8) is None  # step 9 never runs (max_steps 9): nothing to build
    finally:
        lookahead.uninstall()


def test_look_ahead_loader_raises_a_fetch_error_when_that_batch_is_due():
    from specforge_csbp.plugin import lookahead

    wrapped = lookahead.wrap(_Loader(4, fail_at=2), _Core(0, 1))
    try:
        it = iter(wrapped)
        assert int(next(it).tensors["sample_index"]) == 0
        assert int(next(it).tensors["sample_index"]) == 1  # batch 2 already failed to load: not raised yet
        assert wrapped.next_batch(0) is None  # and not announced
        with pytest.raises(OSError, match="batch 2"):
            next(it)
    finally:
        lookahead.uninstall()


def test_install_changes_nothing_where_it_cannot_look_ahead():
    from types import SimpleNamespace

    from specforge_csbp.plugin import lookahead

    queue_loader = _Loader(2)
    queue_loader.queue = object()  # a consume-once stream
    for run in (
        SimpleNamespace(trainer=None, execute=lambda: 0),  # no trainer
        SimpleNamespace(trainer=SimpleNamespace(core=_Core(0, 1))),  # no loader where 0.2.0 keeps it
        SimpleNamespace(trainer=SimpleNamespace(_loader=queue_loader, core=_Core(0, 1))),
        SimpleNamespace(trainer=SimpleNamespace(_loader=_Loader(2), core=object())),  # no accumulation state
    ):
        before = getattr(run.trainer, "_loader", None)
        assert lookahead.install(run) is None and lookahead.current() is None
        assert getattr(run.trainer, "_loader", None) is before
