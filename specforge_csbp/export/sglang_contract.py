"""What SGLang's DFLASH / DFLASH2 drafter loaders read - written down, and checked against an export.

Source: sglang `python/sglang/srt/models/dflash.py` (DFlashDraftModel, DFlash2DraftModel, load_weights) and
`python/sglang/srt/speculative/dflash_utils.py` (parse_dflash_draft_config), read for this project.

config.json
    architectures         ["DFlashDraftModel"] | ["DFlash2DraftModel"]      (SGLang's model registry)
    model_type            "qwen3"                                           (AutoConfig must know it)
    dflash_config         target_layer_ids: non-empty ints, each in [0, num_target_layers)
                          mask_token_id: int >= 0
                          block_size (read first; else top-level block_size; default 16)
                          conv_kernel_size, conv_group_size: both set or both 0 (grouped conv on)
                          selector_rank, selector_top_k: both set or both 0; DFlash2 requires them
    num_target_layers     (dflash_config or top level)
    layer_types           full_attention | sliding_attention per draft layer (+ sliding_window)
    hidden_act            silu

weights (after `load_weights`; TP = 1)
    layers.{i}.self_attn.qkv_proj.weight   [(Hq + 2 Hkv) D, H]   <- q_proj | k_proj | v_proj (fused on load)
    layers.{i}.self_attn.o_proj.weight     [H, Hq D]
    layers.{i}.self_attn.{q,k}_norm.weight [D]
    layers.{i}.{input,post_attention}_layernorm.weight [H]
    layers.{i}.mlp.gate_up_proj.weight     [2 I, H]              <- gate_proj | up_proj (fused on load)
    layers.{i}.mlp.down_proj.weight        [H, I]
    layers.{i}.{attention,mlp}_conv.base_kernel               [2, taps, H]        (conv on)
    layers.{i}.{attention,mlp}_conv.kernel_projection.weight  [2 taps H/group, H] (conv on)
    fc.weight [H, K H]   hidden_norm.weight [H]   norm.weight [H]                 (K = len(target_layer_ids))
    candidate_selector.{predecessor,successor}_codebook [V, r], .hidden_projection.weight [r, H]   (DFlash2)

The loader maps names (`q_proj` -> `qkv_proj` shard q, ..., with or without a `model.` prefix) and
*silently ignores* any tensor it cannot place, and only logs parameters it never received. `check_export`
therefore replays that mapping on the exported names and shapes and fails on anything ignored, missing,
misshaped or partially filled - the failure SGLang itself would not report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ARCHITECTURES", "LoadReport", "check_config", "check_export", "expected_params", "simulate_load"]

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))  # fmt: skip


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config.json: {name} must be an integer >= {minimum}; got {value!r}")
    return value


def _target_layer_ids(config: Mapping[str, Any], dflash: Mapping[str, Any]) -> list[int]:
    """target_layer_ids (dflash_config first, then the top level): non-empty ints within num_target_layers."""
    n_target = dflash.get("num_target_layers", config.get("num_target_layers"))
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(
            f"config.json: dflash_config.target_layer_ids must be a non-empty list of ints; got {ids!r}"
        )
    if n_target is not None:
        n_target = _int(n_target, "num_target_layers", 1)
        bad = [i for i in ids if not 0 <= i < n_target]
        if bad:
            raise ValueError(
                f"config.json: dflash_config.target_layer_ids {bad} out of range for num_target_layers={n_target}"
            )
    return ids


def _dflash2_fields(config: Mapping[str, Any], dflash: Mapping[str, Any], arch: str) -> tuple[int, int, int, int]:
    """(conv_kernel_size, conv_group_size, selector_rank, hidden_size); conv and selector from dflash_config
    only, 0 when off: each pair set together, the selector required by DFlash2DraftModel, the conv groups
    dividing hidden_size."""
    conv_k, conv_g = dflash.get("conv_kernel_size", 0) or 0, dflash.get("conv_group_size", 0) or 0
    rank, top_k = dflash.get("selector_rank", 0) or 0, dflash.get("selector_top_k", 0) or 0
    for name, v in (
        ("conv_kernel_size", conv_k),
        ("conv_group_size", conv_g),
        ("selector_rank", rank),
        ("selector_top_k", top_k),
    ):
        _int(v, f"dflash_config.{name}", 0)
    if bool(conv_k) != bool(conv_g):
        raise ValueError(
            "config.json: dflash_config.conv_kernel_size and conv_group_size must be set together"
        )
    if bool(rank) != bool(top_k):
        raise ValueError("config.json: dflash_config.selector_rank and selector_top_k must be set together")
    if arch == "DFlash2DraftModel" and not rank:
        raise ValueError(
            "config.json: DFlash2DraftModel requires dflash_config.selector_rank / selector_top_k"
        )
    hidden = _int(config.get("hidden_size"), "hidden_size", 1)
    if conv_g and hidden % conv_g:
        raise ValueError(
            f"config.json: dflash_config.conv_group_size={conv_g} must divide hidden_size={hidden}"
        )
    return conv_k, conv_g, rank, hidden


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate config.json the way SGLang parses it; return the resolved fields."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"config.json: architectures must be one of {[[a] for a in ARCHITECTURES]}; got {archs!r}"
        )
    if config.get("model_type") != "qwen3":
        raise ValueError(
            "config.json: model_type must be 'qwen3' (SGLang builds the config with AutoConfig); "
            f"got {config.get('model_type')!r}"
        )
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError("config.json: dflash_config must be a mapping")  # noqa: TRY004
    layers = _int(config.get("num_hidden_layers"), "num_hidden_layers", 1)
    ids = _target_layer_ids(config, dflash)
    block = dflash.get("block_size", config.get("block_size", 16))
    block = _int(block, "dflash_config.block_size", 1)
    mask = dflash.get("mask_token_id")
    mask = _int(mask, "dflash_config.mask_token_id", 0)
    conv_k, conv_g, rank, hidden = _dflash2_fields(config, dflash, archs[0])
    types = config.get("layer_types") or ["full_attention"] * layers
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(
            f"config.json: layer_types must list {layers} of full_attention | sliding_attention; got {types}"
        )
    if "sliding_attention" in types and not config.get("sliding_window"):
        raise ValueError("config.json: sliding_window is required when a layer is sliding_attention")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act must be silu; got {config.get('hidden_act')!r}")
    heads = _int(config.get("num_attention_heads"), "num_attention_heads", 1)
    return {
        "architecture": archs[0], "layers": layers, "hidden": hidden, "heads": heads,
        "kv_heads": _int(config.get("num_key_value_heads", heads), "num_key_value_heads", 1),
        "head_dim": _int(config.get("head_dim", hidden // heads), "head_dim", 1),
        "intermediate": _int(config.get("intermediate_size"), "intermediate_size", 1),
        "vocab": _int(config.get("vocab_size"), "vocab_size", 1), "num_features": len(ids),
        "bias": bool(config.get("attention_bias", False)), "block_size": block, "conv_taps": conv_k,
        "conv_groups": hidden // conv_g if conv_g else 0, "selector_rank": rank, "target_layer_ids": ids,
        "mask_token_id": mask,
    }  # fmt: skip


def expected_params(fields: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """SGLang's parameters (TP = 1) of the drafter described by `check_config`'s fields."""
    H, D, I = fields["hidden"], fields["head_dim"], fields["intermediate"]
    q, kv = fields["heads"] * D, fields["kv_heads"] * D
    out: dict[str, tuple[int, ...]] = {}
    for i in range(fields["layers"]):
        p = f"layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, H)
        out[p + "self_attn.o_proj.weight"] = (H, q)
        if fields["bias"]:
            out[p + "self_attn.qkv_proj.bias"] = (q + 2 * kv,)
            out[p + "self_attn.o_proj.bias"] = (H,)
        out[p + "self_attn.q_norm.weight"] = (D,)
        out[p + "self_attn.k_norm.weight"] = (D,)
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out[p + "mlp.gate_up_proj.weight"] = (2 * I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
        if fields["conv_taps"]:
            for side in ("attention_conv", "mlp_conv"):
                out[p + f"{side}.base_kernel"] = (2, fields["conv_taps"], H)
                out[p + f"{side}.kernel_projection.weight"] = (
                    2 * fields["conv_taps"] * fields["conv_groups"],
                    H,
                )
    out["norm.weight"] = (H,)
    out["fc.weight"] = (H, fields["num_features"] * H)
    out["hidden_norm.weight"] = (H,)
    if fields["architecture"] == "DFlash2DraftModel":
        r, V = fields["selector_rank"], fields["vocab"]
        out["candidate_selector.predecessor_codebook"] = (V, r)
        out["candidate_selector.successor_codebook"] = (V, r)
        out["candidate_selector.hidden_projection.weight"] = (r, H)
    return out


def _shard_rows(fields: Mapping[str, Any], param: str, shard) -> tuple[int, int]:
    D = fields["head_dim"]
    q, kv, I = fields["heads"] * D, fields["kv_heads"] * D, fields["intermediate"]
    if param.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[shard]
    return ((0, I), (I, 2 * I))[shard]


@dataclass
class LoadReport:
    loaded: set[str] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)  # tensors SGLang would skip without a word
    missing: list[str] = field(default_factory=list)  # parameters left at their initial values
    partial: list[str] = field(default_factory=list)  # fused parameters with a shard never written
    shape_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.ignored or self.missing or self.partial or self.shape_errors)

    def summary(self) -> str:
        parts = [f"{len(self.loaded)} parameters loaded"]
        for name in ("ignored", "missing", "partial", "shape_errors"):
            items = getattr(self, name)
            if items:
                parts.append(f"{name}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}")
        return "; ".join(parts)


def simulate_load(fields: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]]) -> LoadReport:
    """Replay SGLang's `load_weights` name mapping on exported (name, shape) pairs."""
    params = expected_params(fields)
    report = LoadReport()
    filled: dict[str, set] = {}

    def resolve(name: str) -> str | None:
        if name in params:
            return name
        alt = name[len("model.") :] if name.startswith("model.") else f"model.{name}"
        return alt if alt in params else None

    for name, shape in tensors.items():
        shape = tuple(shape)
        for param_name, weight_name, shard in _STACKED:
            if f".{weight_name}." not in name:
                continue
            target = resolve(name.replace(weight_name, param_name))
            if target is None:
                continue
            lo, hi = _shard_rows(fields, target, shard)
            want = (hi - lo,) + params[target][1:]
            if shape != want:
                report.shape_errors.append(f"{name} {list(shape)} != shard {shard} of {target} {list(want)}")
            filled.setdefault(target, set()).add(shard)
            report.loaded.add(target)
            break
        else:
            target = resolve(name)
            if target is None:
                report.ignored.append(name)
                continue
            if shape != params[target]:
                report.shape_errors.append(f"{name} {list(shape)} != {list(params[target])}")
            report.loaded.add(target)
    for target, shards in filled.items():
        need = {"q", "k", "v"} if "qkv_proj" in target else {0, 1}
        if shards != need:
            report.partial.append(f"{target} (got shards {sorted(map(str, shards))})")
    report.missing = sorted(set(params) - report.loaded)
    return report


def check_export(config: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]]) -> LoadReport:
    """Config + weights against SGLang's contract; raises a one-line ValueError when SGLang would misload."""
    fields = check_config(config)
    report = simulate_load(fields, tensors)
    if not report.ok:
        raise ValueError(
            f"export does not meet SGLang's {fields['architecture']} loader contract: {report.summary()}"
        )
    return report
