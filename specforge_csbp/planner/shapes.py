"""Model shapes for the cost model, read from a Hugging Face `config.json` (Qwen3/Llama style) or a DFlash
drafter config (SpecForge / SGLang fields: `dflash_config.target_layer_ids`, `layer_types`, `sliding_window`).

Only what the cost model needs: per-layer GEMM widths, attention heads, vocabulary, per-layer windows, and
what the memory model needs to count a decoder layer's saved tensors per family (planner/memory.py
`decoder_layer_bytes_per_row`): the RMSNorm kind and count, q/k norms, mixture-of-experts routing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from ..errors import load_json

__all__ = ["NORM_KINDS", "ModelShape", "load_shape"]

#: RMSNorm kinds: "llama" (Llama / Qwen: fp32 copy, weight times the normalised value cast back to the
#: input dtype) and "gemma" (Gemma: fp32 copy, the fp32 normalised value times (1 + weight))
NORM_KINDS = ("llama", "gemma")
_GEMMA_TYPES = ("gemma3_text", "gemma3", "gemma2")  # four RMSNorms on the hidden stream per layer
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")  # RMSNorm on q and k per head


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    windows: tuple[int | None, ...]  # per layer: sliding window, None = full attention
    drafter: bool = False
    features: int = 0  # drafter: number of target layers whose hidden states form the context
    target_hidden: int = 0  # drafter: target hidden size (width of one feature)
    conv_taps: int = 0  # DFlash2: taps of the grouped dynamic convolution around each sublayer (0 = none)
    conv_groups: int = 0  # DFlash2: channel groups of that convolution (hidden / conv_group_size)
    selector_rank: int = 0  # DFlash2: rank of the candidate selector's codebooks (0 = no selector)
    selector_top_k: int = 0  # DFlash2: candidates the selector scores per row
    norm_kind: str = "llama"  # one of NORM_KINDS
    hidden_norms: int = 2  # RMSNorms on the hidden stream per decoder layer (Gemma 3: 4)
    qk_norm: bool = False  # RMSNorm on every q and k head (Qwen3, Gemma 3)
    experts: int = 0  # MoE: routed experts per sparse layer (0: dense model)
    experts_per_token: int = 0  # MoE: experts each row is sent to (top-k)
    expert_intermediate: int = 0  # MoE: one expert's MLP width
    sparse_layers: tuple[bool, ...] = ()  # MoE: per layer, True where the MLP is the routed experts

    # -- FLOPs (multiply-add = 2) and parameters ----------------------------------------------
    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (q, k, v, o, gate, up, down; norms are negligible; DFlash2: the two
        convolutions' kernel projections hidden -> 2 x taps x groups and base kernels 2 x taps x hidden)."""
        h = self.hidden
        conv = 2 * (h * 2 * self.conv_taps * self.conv_groups + 2 * self.conv_taps * h)
        return h * self.qkv_width + self.heads * self.head_dim * h + 3 * h * self.intermediate + conv

    @property
    def selector_params(self) -> int:
        """DFlash2 candidate selector: predecessor and successor codebooks (vocab x rank) + hidden -> rank."""
        return (2 * self.vocab + self.hidden) * self.selector_rank

    @property
    def dflash2(self) -> bool:
        return bool(self.conv_taps or self.selector_rank)

    def without_dflash2(self) -> ModelShape:
        """The same drafter without DFlash2's convolutions and selector (plain DFlash)."""
        return replace(self, conv_taps=0, conv_groups=0, selector_rank=0, selector_top_k=0)

    def layer_gemm_flops_per_row(self) -> int:
        """Forward GEMM FLOPs of one token row through one layer."""
        return 2 * self.layer_params

    def is_sparse(self, layer: int) -> bool:
        """Is decoder layer `layer`'s MLP the routed experts (MoE)?"""
        return bool(self.experts) and layer < len(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def trainable_params(self) -> int:
        if self.drafter:  # fc (features -> hidden) + draft layers; embeddings and LM head are the target's
            fc = self.features * self.target_hidden * self.hidden
            return fc + self.layers * self.layer_params + self.selector_params
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        # MoE: a sparse layer holds every expert (gate, up, down) and the router instead of the dense MLP
        h, sparse = self.hidden, sum(self.is_sparse(i) for i in range(self.layers))
        experts = self.experts * 3 * h * self.expert_intermediate + h * self.experts - 3 * h * self.intermediate
        return emb + self.layers * self.layer_params + sparse * experts

    @property
    def frozen_params(self) -> int:
        """Drafter: the target's embedding and LM head (frozen, kept in the training dtype)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) if self.drafter else 0

    def attention_flops_per_pair(self) -> int:
        """Forward FLOPs of one visible (query, key) pair in one layer: QK^T and PV over all heads."""
        return 4 * self.heads * self.head_dim


def _get(cfg: dict[str, Any], name: str, path: str) -> Any:
    if name not in cfg:
        raise ValueError(f"model config {path}: missing field {name!r}")
    return cfg[name]


def load_shape(config: str | os.PathLike | dict[str, Any], *, workload: str | None = None) -> ModelShape:
    """A ModelShape from a config.json path or dict; drafter configs are recognised by their fields."""
    path = "<dict>" if isinstance(config, dict) else os.fspath(config)
    if isinstance(config, dict):
        cfg = config
    else:
        cfg = load_json(config, "model")  # missing, a directory, not UTF-8, not JSON: one line with file:line
        if not isinstance(cfg, dict):
            raise ValueError(f"model: {path} must hold a JSON object (a model config)")
    if "text_config" in cfg:  # multimodal wrappers keep the LM in text_config
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k in ("dflash_config", "architectures")}}
    hidden = int(_get(cfg, "hidden_size", path))
    heads = int(_get(cfg, "num_attention_heads", path))
    layers = int(_get(cfg, "num_hidden_layers", path))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["full_attention"] * layers
    if len(types) != layers:
        raise ValueError(f"model config {path}: layer_types has {len(types)} entries, num_hidden_layers is {layers}")
    use_window = cfg.get("use_sliding_window", True)
    windows = tuple(int(window) if (t == "sliding_attention" and window and use_window) else None for t in types)
    archs = " ".join(cfg.get("architectures") or [])
    dflash = cfg.get("dflash_config") or {}
    is_drafter = "DFlash" in archs or bool(dflash) or "num_target_layers" in cfg
    if workload is not None and (workload == "drafter") != is_drafter:
        kind = "a DFlash drafter config" if workload == "drafter" else "a causal LM config (not a drafter)"
        raise ValueError(f"workload {workload!r} needs {kind}; {path} is {'a drafter' if is_drafter else 'not a drafter'}")
    features = len(dflash.get("target_layer_ids") or []) or layers  # DFlash default: one feature per draft layer
    dflash2 = is_drafter and "DFlash2" in archs  # conv + selector fields as SpecForge / SGLang name them
    taps = int(dflash.get("conv_kernel_size") or 0) if dflash2 else 0
    groups = hidden // int(dflash.get("conv_group_size") or hidden) if taps else 0
    model_type = str(cfg.get("model_type") or "")
    gemma = model_type in _GEMMA_TYPES
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts:  # Qwen2/3-MoE: every decoder_sparse_step-th layer not in mlp_only_layers; Mixtral: every layer
        step, dense_only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        expert_width = int(cfg.get("moe_intermediate_size") or _get(cfg, "intermediate_size", path))
    else:
        sparse, expert_width = (), 0
    return ModelShape(
        name=os.path.splitext(os.path.basename(path))[0], hidden=hidden,
        intermediate=int(_get(cfg, "intermediate_size", path)), layers=layers, heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        vocab=int(_get(cfg, "vocab_size", path)), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        windows=windows, drafter=is_drafter, features=features if is_drafter else 0,
        target_hidden=int(cfg.get("target_hidden_size") or hidden) if is_drafter else 0,
        conv_taps=taps, conv_groups=groups,
        selector_rank=int(dflash.get("selector_rank") or 0) if dflash2 else 0,
        selector_top_k=int(dflash.get("selector_top_k") or 0) if dflash2 else 0,
        norm_kind="gemma" if gemma else "llama", hidden_norms=4 if gemma else 2,
        qk_norm=model_type in _QK_NORM_TYPES, experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        expert_intermediate=expert_width, sparse_layers=sparse,
    )  # fmt: skip
