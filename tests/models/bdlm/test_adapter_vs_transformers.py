"""What the BDLM adapter computes, checked against transformers' own attention paths (float64).

- conversion model: for block i, the logits of the corrupted tokens in the 2L training forward equal an
  incremental forward that feeds the clean prefix blocks < i as a KV cache and then block i (bidirectional
  inside the block) - i.e. training sees exactly what block-wise decoding sees;
- the clean rows equal the plain autoregressive forward of the clean sequence;
- the whole 2L forward equals transformers' SDPA attention with the dense 2L mask of the visibility rule.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from specforge_csbp.masks.visibility import Visibility
from specforge_csbp.models.bdlm import ATTENTION_NAME, BDLMModel
from specforge_csbp.models.bdlm.adapter import _set_attention
from specforge_csbp.models.bdlm.tiny import TINY_CONFIGS, float64_norms
from specforge_csbp.objectives.convert import ConvertObjective

S, BLOCKS, VOCAB, MASK = 4, 4, 64, 63
L = S * BLOCKS
TOL = 1e-10


def _model(name: str) -> BDLMModel:
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS[name], dtype=torch.float64, block_size=S, backend="dense")
    float64_norms(model.lm)
    return model.eval()


def _logits(model: BDLMModel, hidden: torch.Tensor) -> torch.Tensor:
    weight, bias = model.head()
    return hidden @ weight.t() + (0 if bias is None else bias)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


def _cache_kwarg(lm) -> str:
    params = inspect.signature(lm.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_conversion_logits_equal_incremental_kv_cache(name):
    from transformers import DynamicCache

    model = _model(name)
    x0 = torch.randint(0, MASK, (2, L), generator=torch.Generator().manual_seed(3))
    batch = ConvertObjective(S, MASK, VOCAB).build(x0, None, [5, 6])  # 4 sequences: 2 views each
    attn = model.attention("reference", L)
    with torch.no_grad():
        train_logits = _logits(model, model(batch.input_ids, attn))
    clean, noisy = batch.input_ids[:, :L], batch.input_ids[:, L:]
    assert (noisy == MASK).any() and (noisy != MASK).any()

    _set_attention(model.lm, "sdpa")  # transformers' own attention from here on
    try:
        key = _cache_kwarg(model.lm)
        with torch.no_grad():
            ar = model.lm(input_ids=clean).logits  # plain causal LM forward of the clean copy
            assert _rel(train_logits[:, :L], ar) <= TOL
            n = noisy.shape[0]
            for i in range(BLOCKS):
                cache = DynamicCache(config=model.lm.config)
                if i:
                    model.lm(input_ids=clean[:, : i * S], use_cache=True, **{key: cache})
                block = slice(i * S, (i + 1) * S)
                visible = torch.ones(n, 1, S, (i + 1) * S, dtype=torch.bool)  # the cache + the whole block
                out = model.lm(
                    input_ids=noisy[:, block],
                    position_ids=torch.arange(i * S, (i + 1) * S)[None].expand(n, -1),
                    attention_mask=visible,
                    use_cache=True,
                    **{key: cache},
                ).logits
                err = _rel(train_logits[:, L:][:, block], out)
                assert err <= TOL, (
                    f"block {i}: corrupted-token logits differ from the KV-cache forward ({err:.2e})"
                )
    finally:
        _set_attention(model.lm, ATTENTION_NAME)


@pytest.mark.parametrize("clean_within_block", ["causal", "bidirectional"])
def test_2l_forward_equals_sdpa_with_dense_rule_mask(clean_within_block):
    torch.manual_seed(0)
    model = BDLMModel.from_config(TINY_CONFIGS["qwen3"], dtype=torch.float64, block_size=S, backend="dense",
                                  clean_within_block=clean_within_block)  # fmt: skip
    float64_norms(model.lm)
    ids = torch.randint(0, VOCAB, (2, 2 * L), generator=torch.Generator().manual_seed(4))
    attn = model.attention("reference", L)
    plan = attn.plan
    with torch.no_grad():
        ours = model(ids, attn)
        mask = Visibility(plan.q_tokens, plan.kv_tokens, S, clean_within_block).dense()
        _set_attention(model.lm, "sdpa")
        try:
            theirs = model.lm.base_model(
                input_ids=ids, position_ids=plan.q_tokens.pos[None].expand(2, -1),
                attention_mask=mask[None, None].expand(2, 1, -1, -1),
            ).last_hidden_state  # fmt: skip
        finally:
            _set_attention(model.lm, ATTENTION_NAME)
    assert _rel(ours, theirs) <= TOL
