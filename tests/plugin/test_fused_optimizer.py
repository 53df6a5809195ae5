"""`FusedBF16Optimizer` computes SpecForge's `BF16Optimizer` update (masters, bf16 weights, grad norm, lr), its
checkpoints load in either class, and the plugin's runs build it."""

from __future__ import annotations

import copy

import pytest
import torch
from specforge.optimizer import BF16Optimizer

from specforge_csbp.plugin.optimizer import FusedBF16Optimizer, connect, install


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 7, bias=False))
    model[0].bias.requires_grad_(False)  # a frozen parameter is skipped by both
    return model.to(torch.bfloat16)


def _grads(model: torch.nn.Module, step: int, scale: float) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype) if p.requires_grad else None


@pytest.mark.parametrize("clip,scale", [(0.5, 1.0), (10.0, 0.01)])  # clipping on / off
@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_fused_optimizer_matches_specforge(clip, scale, schedule):
    kwargs = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=clip, total_steps=6, warmup_ratio=0.34,
                  lr_scheduler=schedule)  # fmt: skip
    ref_model, fused_model = _model(), _model()
    ref, fused = BF16Optimizer(ref_model, **kwargs), FusedBF16Optimizer(fused_model, **kwargs)
    for step in range(5):
        _grads(ref_model, step, scale)
        _grads(fused_model, step, scale)
        ref_norm, fused_norm = ref.step(), fused.step()
        torch.testing.assert_close(fused_norm, ref_norm, rtol=1e-6, atol=0)
        assert fused.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]
        for a, b in zip(fused.fp32_params, ref.fp32_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        for a, b in zip(fused_model.parameters(), ref_model.parameters()):
            assert a.dtype == torch.bfloat16 and a.grad is None and b.grad is None
            torch.testing.assert_close(a, b, rtol=0, atol=0) if step == 0 else torch.testing.assert_close(
                a.float(), b.float(), rtol=1e-2, atol=1e-4
            )
        assert all(mp.grad is None for mp in fused.fp32_params)  # fp32 gradients are not kept between steps
    assert fused.optimizer.param_groups[0]["fused"] is True


@pytest.fixture
def one_rank_group(tmp_path):
    """SpecForge's load_state_dict prints on rank 0 only: it needs a process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checkpoints_load_across_the_two_classes(one_rank_group):
    kwargs = dict(lr=1e-2, max_grad_norm=1.0, total_steps=10, warmup_ratio=0.2)
    model = _model()
    ref = BF16Optimizer(model, **kwargs)
    for step in range(3):
        _grads(model, step, 1.0)
        ref.step()
    state = copy.deepcopy(ref.state_dict())
    resumed = FusedBF16Optimizer(_model(seed=1), **kwargs)
    resumed.load_state_dict(state)
    for a, b in zip(resumed.fp32_params, ref.fp32_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.scheduler.last_epoch == ref.scheduler.last_epoch
    assert resumed.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]


def test_install_makes_specforge_build_the_fused_optimizer():
    from specforge.training import assembly

    original = assembly._optimizer_factory
    with install():
        assert assembly._optimizer_factory is not original
        cfg = type("Cfg", (), {})()
        cfg.training = type("T", (), dict(total_steps=4, max_steps=None, learning_rate=1e-3, max_grad_norm=1.0,
                                         warmup_ratio=0.0, lr_scheduler="cosine", optimizer_cpu_offload=False))()  # fmt: skip
        optimizer = assembly._optimizer_factory(cfg)(_model())
        assert isinstance(optimizer, FusedBF16Optimizer)
    assert assembly._optimizer_factory is original


@pytest.mark.parametrize("clip", [0.5, 10.0])
def test_a_deferred_gradient_scale_equals_specforge_scaling_the_gradients(clip):
    """SpecForge's loop multiplies every gradient by the loss scale (backend.scale_gradients) before the step;
    `connect` routes that to `defer_gradient_scale`, which applies it inside the step. A power-of-two scale
    is exact in bf16, so the two agree to float32 rounding (the scale and clip go in as one fp32 factor)."""
    kwargs = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=clip, total_steps=6, warmup_ratio=0.34)
    ref_model, fused_model = _model(), _model()
    ref, fused = BF16Optimizer(ref_model, **kwargs), FusedBF16Optimizer(fused_model, **kwargs)
    for step in range(4):
        factor = torch.tensor(2.0 ** -(step + 3))
        _grads(ref_model, step, 50.0)
        _grads(fused_model, step, 50.0)
        for p in ref_model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
        fused.defer_gradient_scale(factor)
        torch.testing.assert_close(fused.step(), ref.step(), rtol=1e-6, atol=0)
        for a, b in zip(fused.fp32_params, ref.fp32_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert fused._gradient_scale is None  # consumed by the step it was deferred to


class _Check:
    """A GradientCheck that refuses the step when told to, recording what it was given."""

    def __init__(self, refuse: bool):
        self.refuse, self.norms, self.settled = refuse, None, None

    def device_verdict(self, norms):
        self.norms = norms.clone()
        return torch.tensor([int(self.refuse), 0], dtype=torch.int32)

    def settle(self, verdict):
        self.settled = verdict
        if any(verdict):
            raise RuntimeError("refused")


def test_a_refused_step_changes_nothing_and_a_passed_one_reads_the_norms_once():
    kwargs = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, total_steps=6, warmup_ratio=0.0)
    model = _model()
    opt = FusedBF16Optimizer(model, **kwargs)
    _grads(model, 0, 1.0)
    opt.step()  # moments and step counts exist
    before = copy.deepcopy((opt.optimizer.state_dict(), [mp.detach().clone() for mp in opt.fp32_params],
                            [p.detach().clone() for p in model.parameters()], opt.optimizer.param_groups[0]["lr"]))  # fmt: skip

    opt.gradient_check = refuse = _Check(refuse=True)
    _grads(model, 1, 1.0)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.defer_gradient_scale(0.5)
    with pytest.raises(RuntimeError, match="refused"):
        opt.step()
    assert refuse.settled == [1, 0]
    want = torch.stack([g.float().norm() for g in grads])
    torch.testing.assert_close(refuse.norms, want, rtol=1e-6, atol=0)  # the optimizer's own norms, unscaled
    state, masters, params, lr = before
    after = opt.optimizer.state_dict()["state"]
    for i, s in state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[i][key], s[key]), key
    assert all(torch.equal(a, b) for a, b in zip(opt.fp32_params, masters))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert opt.optimizer.param_groups[0]["lr"] == lr and opt._gradient_scale is None  # the schedule did not move

    opt.gradient_check = passed = _Check(refuse=False)
    _grads(model, 2, 1.0)
    opt.step()
    assert passed.settled == [0, 0]
    assert opt.optimizer.param_groups[0]["lr"] < lr
    assert not all(torch.equal(a, b) for a, b in zip(opt.fp32_params, masters))


def test_connect_routes_the_loops_scaling_and_check_into_the_fused_optimizer():
    from types import SimpleNamespace

    opt = FusedBF16Optimizer(_model(), lr=1e-2, max_grad_norm=1.0, total_steps=4)
    strategy = _Check(refuse=False)
    backend = SimpleNamespace(optimizer=opt, scale_gradients=None)
    run = SimpleNamespace(trainer=SimpleNamespace(core=SimpleNamespace(backend=backend, strategy=strategy)))
    assert connect(run) is opt
    assert backend.scale_gradients == opt.defer_gradient_scale and opt.gradient_check is strategy
    backend.scale_gradients(torch.tensor(0.25))
    torch.testing.assert_close(opt._gradient_scale, torch.tensor(0.25))
    # SpecForge's own optimizer (or masters offloaded to the CPU) keeps SpecForge's loop as it is
    other = SimpleNamespace(optimizer=BF16Optimizer(_model(), lr=1e-2), scale_gradients=None)
    assert connect(SimpleNamespace(trainer=SimpleNamespace(core=SimpleNamespace(backend=other)))) is None
    assert other.scale_gradients is None
