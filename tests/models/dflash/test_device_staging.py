"""A prepared drafter step moves no index tensor to the device: every integer index it reads (gather rows,
positions, context rows, token ids, loss rows) was staged while the step was prepared, in the prefetch
worker; a step nobody prepared stages each one itself, once; both compute the same bits.

On the CPU a copy to the device is a no-op, so copies are detected as calls, not as transfers: a
TorchFunctionMode on the step's thread records every `Tensor.to` / `torch.tensor` / `torch.as_tensor` /
`torch.asarray` / `Tensor.new_tensor` / `Tensor.cuda` call that names a device (and every `nonzero`, a host
sync on a device tensor). The worker thread is not recorded (the mode is per thread): copies there are the
point. Two gloo ranks, float64; CSBP with DFlash2 (two sequences, sliding layers so their context rows are
staged, a sliding layer type used twice, D-PACE, regather) and CP.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specforge_csbp.distributed.collectives import CommStats
from specforge_csbp.models.dflash import AttentionOptions, StepPrefetcher, drafter_step, prepare_step
from tests.models.dflash.test_modes_equal_reference import Case, build
from tests.support.spawned import save_results, spawn_results

SLIDING_TWICE = ("sliding_attention", "full_attention", "sliding_attention")
CASES = [
    Case("csbp", True, (40, 29), 3, sampling="locality", block_size=3, window=5, bucket=5,
         layer_types=SLIDING_TWICE, seed=3),
    Case("csbp", True, (52,), 5, loss_type="dpace", regather=True, seed=2),
    Case("cp", True, (44, 31), 3, layer_types=("full_attention", "sliding_attention"), seed=4),
]  # fmt: skip
FEATURE_WIDTH = 64  # tests/models/dflash/test_modes_equal_reference.py build(): 2 target layers x hidden 32
MOVES = ("to", "cuda", "tensor", "as_tensor", "asarray", "new_tensor")
SYNCS = ("nonzero", "argwhere", "masked_select")


def _names_device(name: str, args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    if name not in ("to", "cuda"):  # factories: data comes first, a device only by keyword
        return False
    if name == "cuda":
        return True
    return any(isinstance(a, (str, torch.device, torch.Tensor)) or type(a) is int for a in args[1:])


class DeviceMoves(TorchFunctionMode):
    """Calls on this thread that move (or create from host data) a tensor on a named device, and syncs."""

    def __init__(self):
        super().__init__()
        self.index: list = []  # (call, dtype, shape) of integer / bool results
        self.other: list = []  # the same for floating-point results
        self.sources: list[int] = []  # id of each tensor moved by `.to` / `.cuda`
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in MOVES and isinstance(out, torch.Tensor) and _names_device(name, args, kwargs):
            integer = not (out.dtype.is_floating_point or out.dtype.is_complex)
            (self.index if integer else self.other).append((name, str(out.dtype), tuple(out.shape)))
            if name in ("to", "cuda"):
                self.sources.append(id(args[0]))
        elif name in SYNCS:
            self.syncs.append(name)
        return out


def _shared_rows(work) -> dict[int, list]:
    """id -> [is a run of first rows, copies = 0] for every gather-rows tensor (ShardPlan.shared) of the
    communicating layer plans (a run is shared as a slice: nothing to copy)."""
    return {
        id(lp.shard.shared): [bool(torch.equal(lp.shard.shared, torch.arange(len(lp.shard.shared)))), 0]
        for _, plan, _ in work for lp in plan.layers.values() if lp.shard.communicates
    }  # fmt: skip


def _step(case, model, head, embed, samples, obj, group, prepared, moves):
    model.zero_grad(set_to_none=True)
    with moves:
        res = drafter_step(
            model, samples, objective=obj, mode=case.mode, head_weight=head, embed_weight=embed, step=1,
            bucket=case.bucket, group=group, options=AttentionOptions(regather=case.regather, stats=CommStats()), prepared=prepared,
        )  # fmt: skip
    return res.loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, out_dir):
    import torch.distributed as dist

    group = dist.group.WORLD
    results = []
    for case in CASES:
        model, head, embed, samples, obj = build(case)
        cfg = model.config

        def prepare(i, cfg=cfg, samples=samples, obj=obj, case=case):
            return prepare_step(
                cfg, samples, objective=obj, mode=case.mode, step=i, group=group, bucket=case.bucket
            )

        # unprepared: the step stages its indices itself (the detector must see them: it can fail)
        lazy = DeviceMoves()
        work = prepare(1)
        loss_lazy, grads_lazy = _step(case, model, head, embed, samples, obj, group, work, lazy)
        gather_rows = _shared_rows(work)
        for src in lazy.sources:
            if src in gather_rows:
                gather_rows[src][1] += 1

        options = AttentionOptions(regather=case.regather)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        with StepPrefetcher(prepare, options, device="cpu", groups=groups, group=group) as prefetcher:
            prepared = prefetcher.take(1)  # the worker now builds step 2 while step 1 runs
            ahead = DeviceMoves()
            loss_ahead, grads_ahead = _step(case, model, head, embed, samples, obj, group, prepared, ahead)
        results.append({
            "case": repr(case),
            "sequences": len(case.seq_lens),
            "lazy_index_moves": lazy.index,
            "gather_rows_copies": sorted(tuple(v) for v in gather_rows.values()),
            "index_moves": ahead.index,
            "other_moves": ahead.other,
            "syncs": ahead.syncs,
            "staged_items": len(prepared.indices),
            "work_items": len(prepared.work),
            "loss_equal": loss_lazy == loss_ahead,
            "grads_equal": all(torch.equal(grads_lazy[n], grads_ahead[n]) for n in grads_lazy),
        })  # fmt: skip
    if rank == 0:
        save_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, 2, tmp_path_factory.mktemp("dflash_device_staging"))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_prepared_step_moves_no_index_to_the_device(results, index):
    r = results[index]
    assert r["staged_items"] == r["work_items"] == r["sequences"], r["case"]
    assert r["index_moves"] == [], f"{r['case']}: index tensors moved during the step: {r['index_moves']}"
    assert r["syncs"] == [], f"{r['case']}: host syncs during the step: {r['syncs']}"
    # what does reach the device on the step's thread: the features of the rank's context rows (load_context)
    # and the RoPE frequencies (a device buffer already: transformers' rotary embedding names x's device)
    for name, dtype, shape in r["other_moves"]:
        assert name == "to" and (shape[-1] == FEATURE_WIDTH or dtype == "torch.float32"), (
            r["case"],
            name,
            shape,
        )


@pytest.mark.parametrize("index", range(len(CASES)))
def test_unprepared_step_stages_each_index_once(results, index):
    r = results[index]
    # positions, token ids, context positions, loss rows / targets / predecessors / mask, per sequence
    assert len(r["lazy_index_moves"]) >= 7 * r["sequences"], r  # so the detector does see index copies
    if "csbp" in r["case"]:  # gather rows: one copy per executor (layer type), however often it runs;
        # none for rows that are a run of first rows (full layers share every context row: a slice)
        copies = [tuple(c) for c in r["gather_rows_copies"]]
        assert copies and all(n == (0 if run else 1) for run, n in copies), copies
        assert {run for run, _ in copies} == {True, False}, copies  # both kinds occur in these cases
    else:
        assert r["gather_rows_copies"] == []  # CP merges partial outputs, gathers no K/V


@pytest.mark.parametrize("index", range(len(CASES)))
def test_prepared_and_unprepared_steps_are_bit_identical(results, index):
    r = results[index]
    assert r["loss_equal"] and r["grads_equal"], r["case"]
