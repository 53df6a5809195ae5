"""Non-finite guard: a NaN/Inf loss or gradient on any rank stops the step on every rank, before the
optimizer, with one message naming the rank and the first offending tensor; weights, optimizer state and
checkpoints stay those of the last good step.

    in process   a tiny linear workload: NaN loss, +Inf gradient -> NonFiniteError, nothing changed
    2 gloo ranks train-bdlm (CSBP): NaN loss / +Inf gradient on rank 1 at step 2 -> both ranks raise the
                 same message; `latest` still names the complete step-1 checkpoint
"""

from __future__ import annotations

import contextlib
import copy
import json
import types

import pytest
import torch

from specforge_csbp.distributed import spawn
from specforge_csbp.training.checkpoint import incomplete_reason
from specforge_csbp.training.step import NonFiniteError, train_step
from tests.support.reliability_runs import GRAD_PARAM, run_recipe, weights
from tests.support.spawned import one_rank_group


class _Linear:
    """loss = sum((W x)^2) over 4 fixed rows; `poison` makes the next loss NaN or the next grad +Inf."""

    def __init__(self):
        self.poison = None

    def microbatches(self, ctx, step):
        return [types.SimpleNamespace(x=torch.arange(12.0).view(4, 3), denominator=4.0)]

    def loss_numerator(self, model, batch, ctx):
        loss = (model(batch.x) ** 2).sum()
        if self.poison == "nan":
            return loss * float("nan")
        if self.poison == "inf":  # one-shot: row 1 of the weight's gradient becomes +inf

            def hook(g):
                handle.remove()
                return g.index_fill(0, torch.tensor([1]), float("inf"))

            handle = model.weight.register_hook(hook)
        return loss


def _linear_run(work: _Linear):
    """(model, optimizer, work, ctx) of a one-rank step over the tiny linear workload."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, work, types.SimpleNamespace(autocast=contextlib.nullcontext)


def test_the_step_is_refused_and_nothing_changes():
    model, opt, work, ctx = _linear_run(_Linear())
    with one_rank_group():
        train_step(model, opt, work, ctx, 0, grad_clip=1.0)
        params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        for poison, tensor in (("nan", "loss numerator of micro batch 0 (nan)"),
                               ("inf", "weight.grad (0 nan, 3 inf of 6)")):  # fmt: skip
            work.poison = poison
            with pytest.raises(NonFiniteError) as err:
                train_step(model, opt, work, ctx, 1, grad_clip=1.0)
            assert str(err.value) == (
                f"step 2: non-finite value on rank 0: first offending tensor {tensor}; the step was not "
                f"applied (weights, optimizer state and checkpoints are those of step 1)"
            )
            assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
            assert all(p.grad is None for p in model.parameters())
            after = opt.state_dict()
            assert after["param_groups"] == state["param_groups"]
            for i, s in state["state"].items():
                assert all(torch.equal(s[k], after["state"][i][k]) for k in s)
        work.poison = None
        train_step(model, opt, work, ctx, 1, grad_clip=1.0)  # the run can go on from the good state
        assert not torch.equal(params["weight"], model.weight.detach())


def _worker(rank, world, root):
    from pathlib import Path

    for kind in ("nan_loss", "inf_grad"):
        out = Path(root) / kind
        try:
            run_recipe(
                ["train.steps=3", f"train.output_dir={out}"], fault={"kind": kind, "rank": 1, "step": 1}
            )
            message = None
        except NonFiniteError as err:
            message = str(err)
        (out / f"error{rank}.json").write_text(json.dumps(message))


def test_two_ranks_stop_together_and_keep_the_checkpoint(tmp_path):
    spawn(_worker, 2, str(tmp_path))
    expect = {
        # rank 0's gradients are poisoned too (through the K/V reduce-scatter), but the loss comes first
        "nan_loss": "rank 1 (also on rank 0): first offending tensor loss numerator of micro batch 0 (nan)",
        "inf_grad": f"rank 1: first offending tensor {GRAD_PARAM}.grad (0 nan, 1 inf of ",
    }
    for kind, where in expect.items():
        out = tmp_path / kind
        messages = [json.loads((out / f"error{r}.json").read_text()) for r in range(2)]
        assert messages[0] == messages[1], messages  # every rank stops, with the same line
        assert messages[0].startswith(f"step 2: non-finite value on {where}"), messages[0]
        assert len(messages[0].splitlines()) == 1
        assert (out / "latest").read_text() == "step_00000001" and incomplete_reason(
            out / "step_00000001"
        ) is None
        assert not (out / "step_00000002").exists() and not list(out.glob(".*tmp"))
        assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1]
    assert weights(tmp_path / "nan_loss").keys() == weights(tmp_path / "inf_grad").keys()
    assert all(torch.equal(a, b) for a, b in zip(weights(tmp_path / "nan_loss").values(),
                                                   weights(tmp_path / "inf_grad").values()))  # fmt: skip


class _OutOfMemoryInBackward(_Linear):
    """The loss's backward runs out of memory; `saved` is a weak reference to a tensor its graph saved."""

    def loss_numerator(self, model, batch, ctx):
        import weakref

        hidden = model(batch.x) * 1.0
        squared = hidden * hidden  # saves `hidden` for backward
        self.saved = weakref.ref(hidden)

        def oom(g):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.")

        squared.register_hook(oom)
        return squared.sum()


def test_an_out_of_memory_step_frees_its_graph_before_it_raises():
    """The trainer retries a step that ran out of memory under auto's choice (training/trainer.py
    `_step_down`) while the exception is being handled: the failed micro batch's graph - its saved
    activations - must already be gone then, not kept alive by the step's frame in the traceback."""
    from specforge_csbp.training.step import StepOutOfMemory

    model, opt, work, ctx = _linear_run(_OutOfMemoryInBackward())
    with one_rank_group():
        try:
            train_step(model, opt, work, ctx, 0, grad_clip=1.0)
        except StepOutOfMemory as err:
            assert "device out of memory on rank 0 (tried to allocate 4.00 GiB)" in str(err)
            assert work.saved() is None  # freed while the exception (and its traceback) is alive
        else:
            raise AssertionError("the step did not run out of memory")
        assert all(p.grad is None for p in model.parameters())
