"""Tiny random-weight model configs (tests, CPU smoke runs) and the Qwen3-1.7B shapes (GPU benchmark)."""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["QWEN3_1_7B", "TINY_CONFIGS", "float64_norms", "float64_routers"]

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA, q/k norms, tied embeddings
    "qwen3": dict(
        model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    # GQA, attention and MLP biases, untied head
    "llama": dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, max_position_embeddings=512,
    ),
    # Qwen2 with a sliding window on layers >= max_window_layers (biases on q/k/v, untied head)
    "qwen2": dict(
        model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
    ),
    # Gemma 3 text: one sliding + one full layer, q/k norms, (1 + w) norms, query_pre_attn_scalar, local RoPE
    "gemma3": dict(
        model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8,
        max_position_embeddings=512, pad_token_id=0,
    ),
    # Qwen3-MoE: 4 experts, top 2, every layer sparse, the router's load-balancing loss on
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.05,
        tie_word_embeddings=False, max_position_embeddings=512,
    ),
}  # fmt: skip

# Qwen/Qwen3-1.7B's config.json shapes (random weights; positions extended for 256K contexts).
QWEN3_1_7B: dict[str, Any] = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, max_position_embeddings=262144,
)  # fmt: skip


def float64_norms(lm: torch.nn.Module) -> int:
    """Make the model's RMSNorms keep float64 (for float64 exactness oracles only; returns how many).

    transformers' RMSNorms compute in float32 whatever the input dtype (`hidden.to(torch.float32)`), which
    puts float32 rounding (~6e-8) into a float64 model: two partitions that sum a row's gradient in
    different pieces (BP's replicated clean rows) then differ at float32 precision. The same formula
    without the downcast makes the float64 model float64 throughout.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != torch.float64:
            return type(self).forward(self, hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def gemma_forward(self, x: torch.Tensor) -> torch.Tensor:  # Gemma's (1 + w) form, `eps`, `x.float()`
        if x.dtype != torch.float64:
            return type(self).forward(self, x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    count = 0
    for module in lm.modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        if hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(forward, module)
            count += 1
        elif type(module).__name__.startswith("Gemma") and hasattr(module, "eps"):
            module.forward = types.MethodType(gemma_forward, module)
            count += 1
    return count


def float64_routers(lm: torch.nn.Module) -> int:
    """Make top-k MoE routers keep float64 (float64 oracles only; returns how many), for the reason of
    `float64_norms`: transformers' routers take the softmax in float32 (`softmax(..., dtype=float)`),
    so the mixing weights of a replicated row carry float32 rounding. Same computation in float64."""

    def forward(self, hidden_states: torch.Tensor):
        if hidden_states.dtype != torch.float64:
            return type(self).forward(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, index

    count = 0
    for module in lm.modules():
        if type(module).__name__.endswith("TopKRouter") and all(
            hasattr(module, a) for a in ("top_k", "norm_topk_prob", "hidden_dim", "weight")
        ):
            module.forward = types.MethodType(forward, module)
            count += 1
    return count
