"""Checkpointed layers that keep their attention outputs (models/bdlm/routing.py, train.recompute_attention):
the recompute never attends again, the gradients are the un-checkpointed ones bit for bit, and what is kept
per row is what the planner's memory model counts (`attention_bytes_per_row`)."""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.models.bdlm import BDLMModel, routing
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS
from specforge_csbp.parallel import sharded_attention
from specforge_csbp.planner.memory import attention_bytes_per_row
from specforge_csbp.planner.shapes import load_shape
from tests.planner.test_decoder_layer_memory_vs_measured import stand_in_flex

L = 16  # clean tokens (2L rows), block 4


def _run(name: str, setting: str, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(loss, gradients, attention calls) of one float64 forward + backward under `setting`: none,
    recompute (every layer checkpointed), kept (checkpointed, every attention kept), mixed (checkpointed,
    layer 0's attention kept, the others recomputed)."""
    calls = [0]
    call = sharded_attention.ShardedAttention.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return call(self, *args, **kwargs)

    monkeypatch.setattr(sharded_attention.ShardedAttention, "__call__", counted)
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS[name], dtype=torch.float64, block_size=4, backend="dense")
    if setting != "none":
        model.enable_activation_checkpointing(keep_attention=setting == "kept")
    if setting == "mixed":
        assert model.keep_attention_outputs([0]) == 1
    model.train()
    ids = torch.randint(1, 60, (1, 2 * L), generator=torch.Generator().manual_seed(1))
    hidden = model(ids, model.attention("reference", L))
    loss = (hidden.square() * torch.linspace(0.5, 1.5, hidden.shape[-1], dtype=hidden.dtype)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls[0]


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_moe"])
def test_kept_attention_is_not_recomputed_and_the_gradients_are_exact(name, monkeypatch):
    layers = TINY_CONFIGS[name]["num_hidden_layers"]
    runs = {s: _run(name, s, monkeypatch) for s in ("none", "recompute", "kept", "mixed")}
    loss0, grads0, calls0 = runs["none"]
    assert calls0 == layers
    assert runs["recompute"][2] == 2 * layers  # every layer attends again in backward
    assert runs["kept"][2] == layers  # no layer does
    assert runs["mixed"][2] == 2 * layers - 1  # all but layer 0
    assert all(g.abs().max() > 0 for g in grads0.values())
    for setting in ("recompute", "kept", "mixed"):
        loss, grads, _ = runs[setting]
        assert torch.equal(loss, loss0), setting
        assert grads.keys() == grads0.keys()
        for k in grads0:
            assert torch.equal(grads[k], grads0[k]), (setting, k)


def test_one_module_called_twice_in_a_forward_is_refused():
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS["qwen3"], dtype=torch.float64, block_size=4, backend="dense")
    model.enable_activation_checkpointing(keep_attention=True)
    model.train()
    attention = model.attention("reference", L)
    layer = model.lm.base_model.layers[0]
    q = torch.randn(1, 4, 2 * L, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 2 * L, 8, dtype=torch.float64)
    route = routing.Route(attention, seq_len=L)
    routing.routed_attention(layer.self_attn, q, kv, kv, csbp_route=route)
    with pytest.raises(RuntimeError, match="called twice in a forward"):
        routing.routed_attention(layer.self_attn, q, kv, kv, csbp_route=route)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_moe"])
def test_kept_bytes_per_row_match_the_memory_model(name, monkeypatch):
    """What a checkpointed layer with its attention kept holds per row - the tensors attention saves
    (through routing's saved-tensor hooks) and the output the recompute reuses - against
    `attention_bytes_per_row`, under bf16 autocast over fp32 weights (train-bdlm on a GPU), flex backend
    with FlexAttention's saved tensors stood in for (its backward cannot run on a CPU)."""
    query_heads = stand_in_flex(monkeypatch)
    cfg = dict(TINY_CONFIGS[name])
    torch.manual_seed(0)
    model = BDLMModel.from_config(cfg, dtype=torch.float32, block_size=4, backend="flex")
    model.enable_activation_checkpointing(keep_attention=True)
    model.train()
    seq = 256  # as the decoder-layer test: the sliding GQA layers pack at this length, the full ones do not
    rows = 2 * seq
    current: list[int | None] = [None]
    kept: list[dict[int, int]] = [{} for _ in model.lm.base_model.layers]
    for i, layer in enumerate(model.lm.base_model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))

    def record(t: torch.Tensor) -> None:
        if current[0] is not None and any(d % rows == 0 for d in t.shape):
            kept[current[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t)
        return t

    monkeypatch.setattr(routing, "_keep", pack)
    call = sharded_attention.ShardedAttention.__call__

    def keeping(self, *args, **kwargs):
        out, lse = call(self, *args, **kwargs)
        record(out)  # the output the recompute reuses (route.kept)
        return out, lse

    monkeypatch.setattr(sharded_attention.ShardedAttention, "__call__", keeping)
    ids = torch.randint(1, 60, (1, rows), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, model.attention("reference", seq))
    shape = load_shape(cfg)
    packed = [h < cfg["num_attention_heads"] for h in query_heads]
    assert len(packed) == shape.layers and (name != "gemma3" or packed == [True, False])
    for i, layer_kept in enumerate(kept):
        got = sum(layer_kept.values()) / rows
        want = attention_bytes_per_row(shape, gemm_bytes=2, gqa_packed=packed[i])
        assert got == pytest.approx(want, rel=0.02), (name, i, got, want)


def _overlap_worker(rank: int, world: int, out_dir: str) -> None:
    """CSBP with the overlap schedule (a local call, then one per other rank's segment, LSE-merged) and every
    layer's attention kept: this rank's summed loss and gradients."""
    import os
    import types

    import torch.distributed as dist

    from specforge_csbp.training.step import global_denominator, reduce_gradients
    from tests.models.bdlm.test_modes_equal_reference import SEQS, _workload

    workload = _workload("qwen3", "sft", "causal", "both", "kept")
    ctx = types.SimpleNamespace(mode="csbp", cp_group=dist.group.WORLD, attention_backend="dense",
                                attention_schedule="overlap")  # fmt: skip
    model = workload.build_model(ctx)
    assert model.schedule == "overlap"
    batch = workload.microbatch(range(SEQS), [11, 22, 33], torch.device("cpu"))
    denom = global_denominator([batch], dist.group.WORLD)
    numerator = workload.loss_numerator(model, batch)
    (numerator / denom).backward()
    params = dict(model.named_parameters())
    reduce_gradients(list(params.values()), dist.group.WORLD)
    loss = numerator.detach().clone()
    dist.all_reduce(loss)
    if rank == 0:
        torch.save({"loss": float(loss / denom), "grads": {k: p.grad for k, p in params.items()}},
                   os.path.join(out_dir, "overlap.pt"))  # fmt: skip


def test_kept_attention_under_the_overlap_schedule_equals_the_reference(tmp_path):
    """The overlap schedule's P - 1 remote calls and merges stay inside the kept region too: CSBP on 3 gloo
    ranks (5 blocks: B % P != 0), float64, against the un-checkpointed single-process reference."""
    from specforge_csbp.distributed import spawn
    from tests.models.bdlm.test_modes_equal_reference import TOL, loss_and_grads
    from tests.support.checks import rel_err

    spawn(_overlap_worker, 3, str(tmp_path), timeout_s=120)
    got = torch.load(tmp_path / "overlap.pt")
    ref_loss, ref_grads = loss_and_grads(("qwen3", "sft", "causal", "both", None), "reference", None)
    assert abs(got["loss"] - ref_loss) / ref_loss <= TOL
    assert got["grads"].keys() == ref_grads.keys()
    assert max(rel_err(got["grads"][k], ref_grads[k]) for k in ref_grads) <= TOL
