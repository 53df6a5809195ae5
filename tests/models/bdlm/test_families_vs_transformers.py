"""Sliding-window and MoE families as BDLMs, checked against transformers' own code paths (float64).

- sliding windows (Qwen2: layer 1 sliding; Gemma 3: a sliding and a full layer; window 6 < L = 16):
  the clean rows of the 2L forward equal the plain causal-LM forward of the clean copy, whose sliding
  layers use transformers' own sliding mask; the corrupted rows of block i equal the served model's
  block-decoding forward over [clean blocks < i, corrupted block i] (block bidirectional, sliding layers
  windowed with transformers' `sliding_window_overlay`, measured from each query's own position);
- the router's load-balancing numerator equals transformers' `load_balancing_loss_func` per sequence
  (every row, and the corrupted rows only through its attention mask);
- `model.pretrained`: a tiny `save_pretrained` checkpoint of every family loads (directly and through the
  recipe) to the same outputs, and the workload's `save_model` exports a directory transformers loads back.
"""

from __future__ import annotations

import pytest
import torch

from specforge_csbp.models.bdlm import ATTENTION_NAME, BDLMModel, BDLMWorkload
from specforge_csbp.models.bdlm.adapter import _set_attention
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS, float64_norms, float64_routers
from specforge_csbp.objectives.router_aux import router_aux_numerator, router_aux_rows
from specforge_csbp.objectives.sft import SFTObjective

S, BLOCKS, VOCAB, MASK = 4, 4, 64, 63
L = S * BLOCKS
TOL = 1e-10
FAMILIES = ["qwen3", "llama", "qwen2", "gemma3", "qwen3_moe"]


def _model(name: str, **kw) -> BDLMModel:
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS[name], dtype=torch.float64, block_size=S, backend="dense", **kw)
    float64_norms(model.lm)
    float64_routers(model.lm)
    return model.eval()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


def _sdpa(model: BDLMModel, fn):
    """Run fn() with transformers' own SDPA attention instead of the routed one."""
    _set_attention(model.lm, "sdpa")
    try:
        with torch.no_grad():
            return fn()
    finally:
        _set_attention(model.lm, ATTENTION_NAME)


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_windowed_rows_equal_transformers_sliding_attention(name):
    from transformers.masking_utils import sliding_window_overlay

    model = _model(name)
    window = model.config.sliding_window
    assert window < L and "sliding_attention" in model.config.layer_types
    x0 = torch.randint(1, MASK, (2, L), generator=torch.Generator().manual_seed(3))
    batch = SFTObjective(S, MASK, VOCAB).build(x0, None, [5, 6])
    attn = model.attention("reference", L)
    with torch.no_grad():
        ours = model(batch.input_ids, attn)
    assert model.layer_windows == tuple(window if t == "sliding_attention" else None for t in model.config.layer_types)
    clean, noisy = batch.input_ids[:, :L], batch.input_ids[:, L:]
    assert (noisy == MASK).any() and (noisy != MASK).any()

    # clean rows: the causal LM's own forward (its sliding layers build transformers' sliding mask)
    ar = _sdpa(model, lambda: model.lm.base_model(input_ids=clean).last_hidden_state)
    assert _rel(ours[:, :L], ar) <= TOL
    # the window matters: the same forward without it differs
    unwindowed = BDLMModel(model.lm, block_size=S, backend="dense")
    full = model.attention("reference", L)
    full.windowed = lambda w: full  # every layer full
    with torch.no_grad():
        assert _rel(unwindowed(batch.input_ids, full)[:, :L], ar) > 1e-3

    # corrupted block i: the served model decodes it over the clean prefix (its KV cache) + the block
    overlay = sliding_window_overlay(window)
    for i in range(BLOCKS):
        n = (i + 1) * S
        ids = torch.cat([clean[:, : i * S], noisy[:, i * S : n]], 1)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        in_block = q >= i * S
        full_mask = torch.where(in_block, k < n, k <= q)  # block rows: prefix + whole block; prefix: causal
        masks = {
            "full_attention": full_mask[None, None].expand(2, 1, -1, -1),
            "sliding_attention": (full_mask & overlay(0, 0, q, k))[None, None].expand(2, 1, -1, -1),
        }
        served = _sdpa(model, lambda: model.lm.base_model(input_ids=ids, attention_mask=masks).last_hidden_state)
        err = _rel(ours[:, L + i * S : L + n], served[:, i * S :])
        assert err <= TOL, f"block {i}: corrupted rows differ from the served block decode ({err:.2e})"


@pytest.mark.parametrize("tokens", ["both", "corrupted"])
def test_router_aux_equals_transformers_load_balancing(tokens):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = _model("qwen3_moe")
    cfg = model.config
    x0 = torch.randint(1, MASK, (2, L), generator=torch.Generator().manual_seed(4))
    batch = SFTObjective(S, MASK, VOCAB).build(x0, None, [7, 8])
    attn = model.attention("reference", L)
    with torch.no_grad():
        _, router = model.forward_with_router_logits(batch.input_ids, attn)
    assert len(router) == cfg.num_hidden_layers and router[0].shape == (2 * 2 * L, cfg.num_experts)
    rows = router_aux_rows(attn.plan, tokens)
    counts = batch.counts.sum(1)
    ours = router_aux_numerator(router, rows, counts, top_k=cfg.num_experts_per_tok)
    expect = 0.0
    for b in range(2):  # transformers' loss over one sequence's rows (its attention mask selects them)
        logits = tuple(r.view(2, 2 * L, -1)[b] for r in router)
        mask = None if tokens == "both" else rows[None].to(torch.long)
        hf = load_balancing_loss_func(logits, cfg.num_experts, cfg.num_experts_per_tok, mask)
        expect += float(counts[b]) * float(hf)
    assert expect > 0
    assert abs(float(ours) - expect) / expect <= 1e-6  # transformers accumulates in float32


def test_router_aux_enters_the_loss():
    """With the model's coefficient the loss and the router gradient change; with 0 they do not."""
    def loss_and_router_grad(coef):
        model = _model("qwen3_moe")
        workload = BDLMWorkload(make_model=lambda: model, objective=SFTObjective(S, MASK, VOCAB),
                                source=_Source(), seq_len=L, router_aux_loss_coef=coef)  # fmt: skip
        ctx = type("Ctx", (), dict(mode="reference", cp_group=None, attention_backend="dense",
                                   attention_schedule=None))()  # fmt: skip
        workload.build_model(ctx)
        batch = workload.microbatch([0, 1], [1, 2], torch.device("cpu"))
        loss = workload.loss_numerator(model, batch)
        loss.backward()
        return float(loss), model.lm.model.layers[0].mlp.gate.weight.grad.clone(), workload.aux_coef

    base, g0, c0 = loss_and_router_grad(0.0)
    with_aux, g1, c1 = loss_and_router_grad(None)  # the model config's coefficient (0.05)
    assert (c0, c1) == (0.0, 0.05)
    assert with_aux > base and _rel(g1, g0) > 1e-6


class _Source:
    def get(self, indices):
        g = torch.Generator().manual_seed(9)
        ids = torch.randint(1, MASK, (len(indices), L), generator=g)
        return ids, torch.ones_like(ids, dtype=torch.bool)


@pytest.mark.parametrize("name", FAMILIES)
def test_pretrained_checkpoint_round_trip(name, tmp_path):
    from transformers import AutoModelForCausalLM

    from specforge_csbp.models.bdlm.recipe import BDLMRecipe, build_workload

    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS[name], block_size=S, backend="dense")
    model.lm.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(1, MASK, (1, 2 * L), generator=torch.Generator().manual_seed(5))
    attn = model.attention("reference", L)
    with torch.no_grad():
        ref = model(ids, attn)

        loaded = BDLMModel.from_pretrained(str(tmp_path / "ckpt"), block_size=S, backend="dense")
        assert type(loaded.lm) is type(model.lm)
        assert torch.equal(loaded(ids, loaded.attention("reference", L)), ref)

        recipe = BDLMRecipe.model_validate(dict(
            model=dict(pretrained=str(tmp_path / "ckpt"), block_size=S), data=dict(max_length=L),
            objective=dict(mask_token_id=MASK),
        ))  # fmt: skip
        workload = build_workload(recipe)
        from_recipe = workload.make_model()
        from_recipe.backend = "dense"
        assert torch.equal(from_recipe(ids, from_recipe.attention("reference", L)), ref)

        workload.save_model(from_recipe, tmp_path / "export")  # the trainer's checkpoint format
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(back) is type(model.lm)
    mine, theirs = model.lm.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("window, clean", [(None, "causal"), (6, "causal"), (6, "bidirectional"), (9, "causal")])
def test_flops_count_the_visible_pairs_of_each_window(window, clean):
    from specforge_csbp.layout.cost import bdlm_visible_pairs
    from specforge_csbp.layout.plans import bdlm_plan
    from specforge_csbp.masks.visibility import Visibility

    plan = bdlm_plan("reference", 24, S, 1)[0]
    dense = Visibility(plan.q_tokens, plan.kv_tokens, S, clean, window=window).dense()
    assert bdlm_visible_pairs(24, S, clean, window) == int(dense.sum())


def test_flops_count_active_experts_only():
    from specforge_csbp.models.bdlm.workload import _matmul_params

    model = BDLMModel.from_config(TINY_CONFIGS["qwen3_moe"], block_size=S)
    cfg = model.config
    attention = cfg.num_hidden_layers * (2 * 32 * 32 + 2 * 16 * 32)
    experts = cfg.num_hidden_layers * cfg.num_experts * 3 * 32 * cfg.moe_intermediate_size
    router = cfg.num_hidden_layers * cfg.num_experts * 32
    assert _matmul_params(model) == attention + router + experts * cfg.num_experts_per_tok / cfg.num_experts


@pytest.mark.parametrize("P, window", [(2, 6), (3, 5), (4, 9)])
def test_clean_keys_needed_elsewhere_match_the_rule(P, window):
    """The rows a windowed CSBP layer would have to share are exactly the clean keys other ranks' queries
    see under the windowed rule - and with dual-end block ownership that is nearly the whole shard."""
    from specforge_csbp.layout.plans import bdlm_plan, clean_keys_needed_elsewhere
    from specforge_csbp.layout.tokens import CLEAN
    from specforge_csbp.masks.visibility import Visibility

    plans = bdlm_plan("csbp", 40, S, P)
    needed = clean_keys_needed_elsewhere(plans, window)
    for r, plan in enumerate(plans):
        seen = torch.zeros(len(plan.kv_tokens), dtype=torch.bool)
        for o, other in enumerate(plans):
            if o != r:
                seen |= Visibility(other.q_tokens, plan.kv_tokens, S, window=window).dense().any(0)
        assert torch.equal(needed[r], seen & (plan.kv_tokens.kind == CLEAN))
    big = bdlm_plan("csbp", 65536, 32, 4)
    share = clean_keys_needed_elsewhere(big, 512)
    fraction = sum(int(m.sum()) for m in share) / sum(int((p.kv_tokens.kind == CLEAN).sum()) for p in big)
    assert fraction > 0.99


def test_train_bdlm_moe_checkpoint_continues_as_pretrained(tmp_path, capsys):
    """train-bdlm on the tiny Qwen3-MoE conversion recipe (one rank, aux loss on) writes a
    save_pretrained checkpoint; a new float64 run starts from it as model.pretrained (the per-expert loop
    replaces the grouped matmul once the trainer casts to float64)."""
    import json
    from pathlib import Path

    from specforge_csbp.cli.main import main

    recipe = str(Path(__file__).resolve().parents[3] / "examples" / "bdlm_convert_qwen3_moe_tiny.yaml")
    first = tmp_path / "first"
    one = ["parallel.world_size=1", "parallel.cp_degree=1"]  # no process start (CSBP: tests/models/bdlm/test_modes_equal_reference.py)
    assert main(["train-bdlm", "-c", recipe, *one, "train.steps=2", "train.warmup_steps=0",
                 f"train.output_dir={first}", "train.progress=false"]) == 0  # fmt: skip
    ckpt = first / "step_00000002"
    assert (ckpt / "config.json").exists() and list(ckpt.glob("*.safetensors"))
    second = tmp_path / "second"
    assert main(["train-bdlm", "-c", recipe, "model.config=null", f"model.pretrained={ckpt}",
                 *one, "train.precision=float64", "train.steps=1",
                 "train.warmup_steps=0", f"train.output_dir={second}", "train.progress=false"]) == 0  # fmt: skip
    (line,) = (second / "log.jsonl").read_text().splitlines()
    assert 0 < json.loads(line)["loss"] < 20


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe"])
def test_activation_checkpointing_keeps_windows_and_router_aux(name):
    """The recompute re-runs windowed layers and the router (aux loss on): same loss and gradients."""
    import types

    def run(checkpointing: bool):
        torch.manual_seed(0)
        model = BDLMModel.from_config(TINY_CONFIGS[name], block_size=S, backend="dense")
        if checkpointing:
            model.enable_activation_checkpointing()
        model.train()
        workload = BDLMWorkload(make_model=lambda: model, objective=SFTObjective(S, MASK, VOCAB), source=_Source(),
                                seq_len=L)  # fmt: skip
        ctx = types.SimpleNamespace(mode="reference", cp_group=None, attention_backend="dense",
                                    attention_schedule=None)  # fmt: skip
        workload.build_model(ctx)
        loss = workload.loss_numerator(model, workload.microbatch([0, 1], [1, 2], torch.device("cpu")))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, workload.aux_coef

    (l0, g0, c0), (l1, g1, c1) = run(False), run(True)
    assert c0 == c1 == (0.05 if name == "qwen3_moe" else 0.0)
    assert torch.equal(l0, l1) and all(torch.allclose(g0[k], g1[k], rtol=0, atol=1e-6) for k in g0)
