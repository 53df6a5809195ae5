"""Tiny random-weight model configs (tests, CPU smoke runs) and the Qwen3-1.7B shapes (GPU benchmark)."""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["QWEN3_1_7B", "TINY_CONFIGS", "float64_norms"]

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

    count = 0
    for module in lm.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(forward, module)
            count += 1
    return count
