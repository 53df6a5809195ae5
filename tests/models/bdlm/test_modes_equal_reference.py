"""BDLM training under CSBP / CP / BP equals the single-process reference: loss and every parameter
gradient, float64, tiny Qwen3, Llama, Qwen2 (a sliding window of 6 on layer 1), Gemma 3 (a sliding and
a full layer) and Qwen3-MoE (4 experts, top 2, the router's load-balancing loss on) with random weights,
SFT and conversion objectives.

L = 5 blocks of 4 tokens, so B % P != 0 for P = 2, 3, 4 and P <= B < 2P for P = 3, 4; the window (6) is
shorter than the sequence, so sliding layers cut keys of clean and corrupted queries alike. Qwen3 and
Llama run every mode at every P; the other families run CSBP at P = 2, 3, 4, CP at 3 and BP at 4 (the
modes share the executor, the plans are covered above) to keep the test short. All cases run in one
spawned group of 4 gloo ranks (sub-groups of 2 and 3), built through the same workload / step functions the
trainer uses (global denominator, summed gradients). transformers' RMSNorms compute in float32 whatever the
input dtype, MoE routers their softmax; `float64_norms` / `float64_routers` keep them float64 so the model
is a float64 oracle (see their docstrings). Activation checkpointing - every layer recomputed, or with
its attention output kept - is checked the same way against the un-checkpointed reference.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

from specforge_csbp.distributed import spawn
from specforge_csbp.models.bdlm import BDLMModel, BDLMWorkload
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS, float64_norms, float64_routers
from specforge_csbp.objectives.convert import ConvertObjective
from specforge_csbp.objectives.sft import SFTObjective
from specforge_csbp.training.step import global_denominator, reduce_gradients
from tests.support.checks import rel_err

BLOCK, BLOCKS, SEQS, VOCAB, MASK = 4, 5, 3, 64, 63
L = BLOCK * BLOCKS
TOL = 1e-10

ALL_MODES = [
    ("csbp", 2),
    ("csbp", 3),
    ("csbp", 4),
    ("cp", 2),
    ("cp", 3),
    ("cp", 4),
    ("bp", 2),
    ("bp", 3),
    ("bp", 4),
]
SOME_MODES = [("csbp", 2), ("csbp", 3), ("csbp", 4), ("cp", 3), ("bp", 4)]

# (model, objective, clean_within_block, router_aux_tokens, activation checkpointing) -> modes; the
# reference of every setup runs un-checkpointed, so a checkpointed setup is checked against plain autograd:
# "recompute" re-runs every layer (attention and its collectives too), "kept" keeps attention's outputs
# (models/bdlm/routing.py)
SETUPS = {
    ("qwen3", "sft", "causal", "both", None): ALL_MODES,
    ("qwen3", "convert", "causal", "both", None): ALL_MODES,
    ("llama", "sft", "causal", "both", None): ALL_MODES,
    ("llama", "convert", "causal", "both", None): ALL_MODES,
    ("qwen3", "sft", "bidirectional", "both", None): ALL_MODES,
    ("qwen2", "sft", "causal", "both", None): SOME_MODES,
    ("qwen2", "convert", "causal", "both", None): SOME_MODES,
    ("gemma3", "sft", "causal", "both", None): SOME_MODES,
    ("gemma3", "convert", "bidirectional", "both", None): SOME_MODES,
    ("qwen3_moe", "sft", "causal", "both", None): SOME_MODES,
    ("qwen3_moe", "convert", "causal", "corrupted", None): [("csbp", 3), ("bp", 3)],
    ("qwen3", "sft", "causal", "both", "recompute"): [("csbp", 3), ("cp", 2)],
    ("qwen3", "sft", "causal", "both", "kept"): SOME_MODES,
    ("gemma3", "convert", "causal", "both", "kept"): [("csbp", 2), ("cp", 3)],
    ("qwen3_moe", "sft", "causal", "both", "kept"): [("csbp", 4)],
}


class _Fixed:
    """A token source over fixed sequences (sequence id = row)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, MASK, (SEQS, L), generator=g)
        self.mask = torch.ones(SEQS, L, dtype=torch.bool)
        self.mask[0, :3] = False  # a prompt: never masked nor supervised
        self.mask[2, -2:] = False  # padding at the end

    def get(self, indices):
        return self.ids[list(indices)], self.mask[list(indices)]


def _objective(name: str):
    if name == "sft":
        return SFTObjective(BLOCK, MASK, VOCAB, noise="stratified", weighting="inv_t", denominator="eligible")
    if name == "sft-unit":
        return SFTObjective(BLOCK, MASK, VOCAB, noise="antithetic", weighting="unit", denominator="masked")
    return ConvertObjective(BLOCK, MASK, VOCAB)


NORMS = {"qwen3": 9, "llama": 5, "qwen2": 5, "gemma3": 13, "qwen3_moe": 9}  # RMSNorms kept float64


def _workload(model_name: str, objective: str, clean: str, aux_tokens: str = "both",
              checkpointing: str | None = None, *, reference: bool = False) -> BDLMWorkload:  # fmt: skip
    def make():
        torch.manual_seed(0)
        model = BDLMModel.from_config(TINY_CONFIGS[model_name], dtype=torch.float64, block_size=BLOCK,
                                      clean_within_block=clean, backend="dense")  # fmt: skip
        assert float64_norms(model.lm) == NORMS[model_name]
        assert float64_routers(model.lm) == (2 if model_name == "qwen3_moe" else 0)
        if checkpointing and not reference:
            model.enable_activation_checkpointing(keep_attention=checkpointing == "kept")
        return model

    # llama runs the unit-weight / masked-denominator SFT variant, qwen3 the 1/t / eligible one
    obj = "sft-unit" if (objective == "sft" and model_name == "llama") else objective
    return BDLMWorkload(make_model=make, objective=_objective(obj), source=_Fixed(), seq_len=L,
                        exclude_mask_from_softmax=model_name == "qwen3", router_aux_tokens=aux_tokens)  # fmt: skip


def loss_and_grads(setup, mode: str, group) -> tuple[float, dict[str, torch.Tensor]]:
    """One step's loss and summed gradients on this rank's share (mode 'reference' when group is None: never
    checkpointed)."""
    workload = _workload(*setup, reference=group is None)
    ctx = types.SimpleNamespace(mode=mode, cp_group=group, attention_backend="dense", attention_schedule=None)
    model = workload.build_model(ctx)
    assert workload.aux_coef == (0.05 if setup[0] == "qwen3_moe" else 0.0)
    batch = workload.microbatch(range(SEQS), [11, 22, 33], torch.device("cpu"))
    denom = global_denominator([batch], group) if group is not None else torch.tensor(batch.denominator)
    numerator = workload.loss_numerator(model, batch)
    (numerator / denom).backward()
    params = dict(model.named_parameters())
    loss = numerator.detach().clone()
    if group is not None:
        reduce_gradients(list(params.values()), group)
        dist.all_reduce(loss, group=group)
    return float(loss / denom), {k: p.grad.detach().clone() for k, p in params.items()}


def _worker(rank: int, world: int, out_dir: str) -> None:
    groups = {p: dist.new_group(list(range(p))) for p in (2, 3)}
    groups[4] = dist.group.WORLD
    for i, (setup, modes) in enumerate(SETUPS.items()):
        for mode, p in modes:
            if rank >= p:
                continue
            loss, grads = loss_and_grads(setup, mode, groups[p])
            if rank == 0:
                torch.save({"loss": loss, "grads": grads}, os.path.join(out_dir, f"{i}-{mode}-{p}.pt"))
    for i in range(rank, len(SETUPS), world):  # the single-process references, spread over the ranks
        loss, grads = loss_and_grads(list(SETUPS)[i], "reference", None)
        torch.save({"loss": loss, "grads": grads}, os.path.join(out_dir, f"{i}-reference.pt"))


def test_bdlm_modes_equal_reference(tmp_path):
    spawn(_worker, 4, str(tmp_path), timeout_s=300)
    for i, (setup, modes) in enumerate(SETUPS.items()):
        ref = torch.load(tmp_path / f"{i}-reference.pt")
        ref_loss, ref_grads = ref["loss"], ref["grads"]
        assert ref_loss > 0
        for name, g in ref_grads.items():  # every gradient is informative, so the comparison can fail
            assert g.abs().max() > 0, f"{setup} reference grad of {name} is zero"
        for mode, p in modes:
            got = torch.load(tmp_path / f"{i}-{mode}-{p}.pt")
            where = f"{setup} {mode} P={p}"
            assert abs(got["loss"] - ref_loss) / ref_loss <= TOL, f"{where}: loss {got['loss']} vs {ref_loss}"
            assert got["grads"].keys() == ref_grads.keys()
            errors = {n: rel_err(got["grads"][n], ref_grads[n]) for n in ref_grads}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOL, f"{where}: grad {worst} max rel err {errors[worst]:.2e}"


def test_noise_is_partition_free():
    """The same sequence gets the same corruption whatever batch it is built in (noise per sequence seed)."""
    src = _Fixed()
    for obj in (_objective("sft"), _objective("convert")):
        whole = obj.build(src.ids, src.mask, [11, 22, 33])
        part = obj.build(src.ids[1:2], src.mask[1:2], [22])
        k = obj.batch_factor
        assert torch.equal(whole.input_ids[k : 2 * k], part.input_ids)
        assert torch.equal(whole.labels[k : 2 * k], part.labels)
        other = obj.build(src.ids[1:2], src.mask[1:2], [23])
        assert not torch.equal(other.input_ids, part.input_ids)


@pytest.mark.parametrize("kind", ["sft", "convert"])
def test_objective_semantics(kind):
    """SFT: masked eligible tokens supervise themselves; conversion: complementary views, shifted labels."""
    src = _Fixed()
    obj = _objective(kind)
    b = obj.build(src.ids, src.mask, [11, 22, 33])
    clean, noisy = b.input_ids[:, :L], b.input_ids[:, L:]
    assert (b.labels[:, :L] == -100).all() and (b.counts[:, :L] == 0).all()  # clean rows carry no loss
    labels = b.labels[:, L:]
    if kind == "sft":
        masked = noisy == MASK
        assert torch.equal(masked, masked & src.mask)  # only eligible tokens are masked
        assert torch.equal(labels, torch.where(masked, clean, torch.full_like(clean, -100)))
        assert b.denominator == float(src.mask.sum())
        t = 1.0 / b.weights[:, L:][masked]
        assert ((t > 0) & (t <= 1)).all()
    else:
        a, c = noisy[0::2] == MASK, noisy[1::2] == MASK
        assert torch.equal(a ^ c, src.mask) and not (a & c).any()  # each eligible token masked exactly once
        for view, masked in ((0, a), (1, c)):
            lab = labels[view::2]
            expect = torch.where(masked[:, 1:], clean[view::2, 1:], torch.full_like(clean[::2, 1:], -100))
            assert torch.equal(lab[:, :-1], expect) and (lab[:, -1] == -100).all()
        assert b.denominator == float(src.mask[:, 1:].sum())
        assert (b.weights[:, L:][labels != -100] == 1).all()
