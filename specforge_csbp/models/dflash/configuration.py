"""DFlashConfig: a Qwen3 config plus the DFlash fields SGLang's DFLASH / DFLASH2 loaders read.

config.json of an exported drafter (the serving contract, tests/models/dflash/test_loader_contract.py):

    model_type            "qwen3"          (SGLang builds the config with AutoConfig)
    architectures         ["DFlashDraftModel"] or ["DFlash2DraftModel"]
    block_size            S (also mirrored in dflash_config.block_size, which SGLang reads first)
    num_target_layers     layers of the target model
    dflash_config         {target_layer_ids: [...] (0-based target layers; feature k is the output of
                           layer target_layer_ids[k], i.e. HF hidden_states[id + 1]),
                           mask_token_id,
                           DFlash2 only: conv_kernel_size, conv_group_size, selector_rank, selector_top_k}
    layer_types           full_attention | sliding_attention per draft layer, with sliding_window
    is_causal             optional; False makes every layer bidirectional inside a block (the trainer and
                          SGLang / vLLM agree); True is refused unless every layer is sliding_attention
                          (SGLang / vLLM would make full_attention layers causal, the trainer does not), and
                          dflash_config.causal is refused (SGLang ignores it, vLLM applies it to every layer)

Validation errors are one line and name the field (`validate_dflash`).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

__all__ = ["DFLASH2_ARCH", "DFLASH2_FIELDS", "DFLASH_ARCH", "DFlashConfig", "build_target_layer_ids",
           "make_dflash_config", "plain_dflash"]  # fmt: skip

DFLASH_ARCH = "DFlashDraftModel"
DFLASH2_ARCH = "DFlash2DraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default feature layers of SpecForge / SGLang: evenly spread over [1, L - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


#: dflash_config fields only DFlash2 has: the grouped dynamic convolution and the candidate selector
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def plain_dflash(raw: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict of a DFlash2 drafter as plain DFlash (what SpecForge 0.2.0 trains): the same
    layers, widths and block size without the convolutions and the selector."""
    out = dict(raw, architectures=[DFLASH_ARCH])
    out["dflash_config"] = {k: v for k, v in (raw.get("dflash_config") or {}).items() if k not in DFLASH2_FIELDS}
    return out


class DFlashConfig(Qwen3Config):
    """Qwen3Config carrying `block_size`, `num_target_layers` and `dflash_config` (kept as plain attributes,
    so config.json stays readable by SGLang's AutoConfig and by SpecForge)."""

    # -- resolved fields ----------------------------------------------------------------------------
    @property
    def dflash(self) -> dict[str, Any]:
        return dict(getattr(self, "dflash_config", None) or {})

    @property
    def architecture(self) -> str:
        archs = getattr(self, "architectures", None) or [DFLASH_ARCH]
        return str(archs[0])

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2_ARCH

    @property
    def draft_block_size(self) -> int:
        value = self.dflash.get("block_size", getattr(self, "block_size", None))
        if value is None:
            raise ValueError("block_size: missing from the config (top-level or dflash_config.block_size)")
        return int(value)

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash.get("target_layer_ids")
        if ids is None:
            return build_target_layer_ids(self.target_num_layers, self.num_hidden_layers)
        return [int(i) for i in ids]

    @property
    def target_num_layers(self) -> int:
        value = self.dflash.get("num_target_layers", getattr(self, "num_target_layers", None))
        if value is None:
            raise ValueError("num_target_layers: missing from the config (the target model's layer count)")
        return int(value)

    @property
    def mask_token_id(self) -> int:
        value = self.dflash.get("mask_token_id")
        if value is None:
            raise ValueError("dflash_config.mask_token_id: missing (the token id of the draft MASK slots)")
        return int(value)

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def sliding_layers_causal(self) -> bool:
        """Sliding layers see their own block causally unless the config says is_causal = false (full layers
        are always bidirectional: `validate_dflash` refuses configs a server would run otherwise)."""
        value = getattr(self, "is_causal", None)
        return True if value is None else bool(value)

    def dflash2_field(self, name: str) -> int:
        value = self.dflash.get(name)
        if value is None:
            raise ValueError(f"dflash_config.{name}: required for {DFLASH2_ARCH}")
        return int(value)

    # -- validation ---------------------------------------------------------------------------------
    def validate_dflash(self) -> None:
        """One-line errors naming the offending field."""
        if self.architecture not in (DFLASH_ARCH, DFLASH2_ARCH):
            raise ValueError(
                f"architectures must be [{DFLASH_ARCH!r}] or [{DFLASH2_ARCH!r}]; got {self.architectures}"
            )
        top, nested = getattr(self, "block_size", None), self.dflash.get("block_size")
        if top is not None and nested is not None and int(top) != int(nested):
            raise ValueError(
                f"block_size: top-level {top} != dflash_config.block_size {nested}; they must agree"
            )
        size = self.draft_block_size
        if size < 2:
            raise ValueError(
                f"block_size must be >= 2 (slot 0 holds the anchor, slots 1.. are drafted); got {size}"
            )
        n_target = self.target_num_layers
        if n_target < 1:
            raise ValueError(f"num_target_layers must be >= 1; got {n_target}")
        ids = self.target_layer_ids
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(
                f"dflash_config.target_layer_ids must be a non-empty list of distinct ints; got {ids}"
            )
        for i, layer in enumerate(ids):
            if not 0 <= layer < n_target:
                raise ValueError(
                    f"dflash_config.target_layer_ids[{i}] = {layer} is out of range for "
                    f"num_target_layers = {n_target}; allowed 0..{n_target - 1}"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"dflash_config.mask_token_id = {self.mask_token_id} must be in 0..vocab_size-1 = {self.vocab_size - 1}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads = {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        types = list(self.layer_types or [])
        if len(types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"layer_types must list num_hidden_layers = {self.num_hidden_layers} entries of "
                f"{' | '.join(LAYER_TYPES)}; got {types}"
            )
        if "sliding_attention" in types and (self.sliding_window is None or self.sliding_window < size):
            raise ValueError(
                f"sliding_window must be >= block_size = {size} when a layer is sliding_attention "
                f"(set use_sliding_window=True); got {self.sliding_window}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be silu; got {self.hidden_act!r}")
        self._validate_causality(types)
        if self.is_dflash2:
            taps, group = self.dflash2_field("conv_kernel_size"), self.dflash2_field("conv_group_size")
            rank, top_k = self.dflash2_field("selector_rank"), self.dflash2_field("selector_top_k")
            if not 1 <= taps <= size:
                raise ValueError(f"dflash_config.conv_kernel_size = {taps} must be in 1..block_size = {size}")
            if group < 1 or self.hidden_size % group:
                raise ValueError(
                    f"dflash_config.conv_group_size = {group} must divide hidden_size = {self.hidden_size}"
                )
            if rank < 1:
                raise ValueError(f"dflash_config.selector_rank must be >= 1; got {rank}")
            if not 1 <= top_k <= self.vocab_size:
                raise ValueError(
                    f"dflash_config.selector_top_k = {top_k} must be in 1..vocab_size = {self.vocab_size}"
                )

    def _validate_causality(self, types: list[str]) -> None:
        """Train what the server runs: SGLang reads only the top-level is_causal (True: every layer causal,
        False: every layer bidirectional, unset: sliding layers causal, full layers bidirectional) and ignores
        dflash_config.causal, which vLLM applies to every layer."""
        if "causal" in self.dflash:
            raise ValueError(
                f"dflash_config.causal = {self.dflash['causal']!r} is not read by SGLang (vLLM applies it to every "
                "layer); remove it and set the top-level is_causal: false (every layer bidirectional) or leave it "
                "unset (sliding layers causal)"
            )
        value = getattr(self, "is_causal", None)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"is_causal must be true, false or unset; got {value!r}")
        if value is True and "full_attention" in types:
            raise ValueError(
                "is_causal = true makes SGLang and vLLM run full_attention layers causally, which the trainer keeps "
                "bidirectional; allowed: false, unset, or true only when every layer is sliding_attention"
            )


def make_dflash_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    vocab_size: int,
    num_target_layers: int,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
    block_size: int = 16,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    dflash2: bool = False,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 256,
    selector_top_k: int = 16,
    rope_theta: float = 1e6,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 1 << 20,
    **extra: Any,
) -> DFlashConfig:
    """A validated DFlash / DFlash2 config with every serving field in place."""
    layer_types = list(layer_types or ["full_attention"] * num_hidden_layers)
    dflash: dict[str, Any] = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(
            target_layer_ids
            if target_layer_ids is not None
            else build_target_layer_ids(num_target_layers, num_hidden_layers)
        ),
    }
    if dflash2:
        dflash.update(
            conv_kernel_size=conv_kernel_size,
            conv_group_size=conv_group_size,
            selector_rank=selector_rank,
            selector_top_k=selector_top_k,
        )
    sliding = "sliding_attention" in layer_types
    if is_causal is not None:
        extra["is_causal"] = is_causal
    config = DFlashConfig(
        architectures=[DFLASH2_ARCH if dflash2 else DFLASH_ARCH],
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        layer_types=layer_types,
        use_sliding_window=sliding,
        sliding_window=sliding_window if sliding else None,
        max_window_layers=num_hidden_layers,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config=dflash,
        **extra,
    )
    config.validate_dflash()
    return config
