"""Write an exported drafter directory (`--to sglang`, `--to vllm` or `--to hf`) with its provenance.

    OUT/
      config.json          the drafter config (the serving fields; checked the way the server parses them)
      model.safetensors    drafter weights under the checkpoint names both servers read (q/k/v and gate/up
                           unfused: SGLang and vLLM fuse on load; no `model.` prefix: vLLM adds its own)
      provenance.json      source checkpoint path + sha256, strategy, step, config, objective, file hashes,
                           dtype (and where it came from), the minimum SGLang / vLLM releases that load it

`--to hf` is `save_pretrained` (loadable with `DFlash2DraftModel.from_pretrained(OUT)`); `--to sglang` is
checked against SGLang's loader contract (export/sglang_contract.py), `--to vllm` against vLLM's as well
(export/vllm_contract.py); either fails instead of writing a directory the server would load with silently
missing weights. The dtype is the target model's (its config's `torch_dtype` / `dtype`) unless `--dtype`
says otherwise: SGLang's `--dtype auto` serves a float32 drafter config as float16, so a drafter exported
in float32 beside a bf16 target would run in neither dtype. The directory is written next to OUT and
renamed into place, so OUT is either complete or absent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from .. import __version__
from ..compat import check_drafter_target, read_target_config
from ..errors import load_json
from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
from ..outputs import file_sha256, staged_dir
from .checkpoint import DrafterCheckpoint, load_checkpoint
from .sglang_contract import check_export
from .vllm_contract import check_vllm_export

__all__ = [
    "EXPORT_FORMAT", "SGLANG_FLOORS", "TARGETS", "VLLM_FLOORS", "ExportResult", "export_drafter", "load_exported",
    "serve_command", "serve_commands", "server_floors", "target_dtype",
]  # fmt: skip

EXPORT_FORMAT = "specforge-csbp-export/1"
TARGETS = ("sglang", "vllm", "hf")
# The first releases that load each architecture as this project trains it (docs/specforge.md, "Serving"):
# SGLang 0.5.14 (SpecForge 0.2.0's pin) registers only DFlashDraftModel; DFlash2DraftModel arrives in 0.5.19.
# Checked in CI against the wheels' own loaders (tests/export/test_sglang_real_loaders.py).
SGLANG_FLOORS = {"DFlashDraftModel": "0.5.14", "DFlash2DraftModel": "0.5.19"}
# A top-level is_causal: false is honoured from SGLang 0.5.18 on; before, sliding layers stay causal.
SGLANG_IS_CAUSAL_FLOOR = "0.5.18"
# vLLM: DFlash2 (qwen3_dflash2.py) and the top-level is_causal arrive in 0.28.0 (read from the wheels).
VLLM_FLOORS = {"DFlashDraftModel": "0.28.0", "DFlash2DraftModel": "0.28.0"}
_DTYPES = ("float32", "bfloat16", "float16")
PROVENANCE = "provenance.json"


@dataclass
class ExportResult:
    out: str
    architecture: str
    block_size: int
    num_tensors: int
    contract: str | None  # the loader-contract summary (sglang / vllm)
    dtype: str = "float32"
    dtype_source: str = "checkpoint"
    config: dict | None = None
    servers: tuple[str, ...] = ()  # the servers whose loader contract the export meets


def _check_out(out: str, overwrite: bool) -> None:
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise ValueError(f"OUT: {out} exists and is not a directory")
    if not os.listdir(out):
        return
    if not overwrite:
        raise ValueError(f"OUT: {out} already exists; pass --overwrite to replace it")
    if not os.path.isfile(os.path.join(out, PROVENANCE)):
        raise ValueError(
            f"OUT: {out} is not a specforge-csbp export (no {PROVENANCE}); refusing to overwrite it"
        )


def _model(ckpt: DrafterCheckpoint, dtype: torch.dtype):
    cls = DFlash2DraftModel if ckpt.architecture == "DFlash2DraftModel" else DFlashDraftModel
    model = cls(ckpt.config)
    model.load_state_dict(ckpt.state_dict, strict=True)
    return model.to(dtype).eval()


def _serving_config(model, dtype_name: str) -> dict:
    """config.json with every field SGLang's loader reads, at both places it looks for them."""
    data = model.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "torch_dtype"):
        data.pop(key, None)
    dflash = dict(data.get("dflash_config") or {})
    dflash.setdefault("block_size", int(model.block_size))
    dflash["target_layer_ids"] = [int(i) for i in model.target_layer_ids]
    dflash["mask_token_id"] = int(model.mask_token_id)
    data.update(
        architectures=[model.config.architecture], model_type="qwen3", dflash_config=dflash,
        block_size=int(dflash["block_size"]), num_target_layers=int(model.config.target_num_layers),
        tie_word_embeddings=False, dtype=dtype_name,
    )  # fmt: skip
    return data


def target_dtype(target: str | None) -> str | None:
    """The dtype a target model directory declares (config.json `dtype` / `torch_dtype`, or its text_config's);
    None when there is no such directory or it declares none."""
    path = os.path.join(target, "config.json") if target else ""
    if not path or not os.path.isfile(path):
        return None
    config = load_json(path, "--target")  # not UTF-8 or not JSON: one line naming the file and the line
    for where in (config, config.get("text_config") or {}):
        value = where.get("dtype") or where.get("torch_dtype")
        if value is not None:
            value = str(value).replace("torch.", "")
            if value not in _DTYPES:
                raise ValueError(
                    f"--target: {path} declares dtype {value!r}; expected one of {', '.join(_DTYPES)}"
                )
            return value
    return None


def server_floors(config: dict) -> dict[str, str]:
    """The minimum SGLang / vLLM releases that serve this drafter config as trained."""
    arch = config["architectures"][0]
    sglang = SGLANG_FLOORS[arch]
    if config.get("is_causal") is False and "sliding_attention" in (config.get("layer_types") or []):
        sglang = max(sglang, SGLANG_IS_CAUSAL_FLOOR, key=lambda v: tuple(map(int, v.split("."))))
    return {"sglang": sglang, "vllm": VLLM_FLOORS[arch]}


def export_drafter(
    checkpoint: str, out: str, *, to: str = "sglang", overwrite: bool = False, dtype: str | None = None,
    target: str | None = None,
) -> ExportResult:  # fmt: skip
    """Export CHECKPOINT to OUT for `to`. dtype: --dtype, else the target's (`target` = its directory), else
    the weights' dtype as trained."""
    from safetensors.torch import save_file

    if to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}; got {to!r}")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    _check_out(out, overwrite)
    ckpt = load_checkpoint(checkpoint)
    if target is not None:  # the serve commands name it: it must be the target this drafter reads
        check_drafter_target(ckpt.config, read_target_config(target, "--target"), f"CHECKPOINT {checkpoint}",
                             f"--target {target}", trained_for=ckpt.trained_for, target_path=target)  # fmt: skip
    declared = target_dtype(target)
    if dtype is not None:
        dtype_name, dtype_source = dtype, "--dtype"
    elif declared is not None:
        dtype_name, dtype_source = declared, f"target {os.path.abspath(target)}"
    else:
        dtype_name = str(next(iter(ckpt.state_dict.values())).dtype).replace("torch.", "")
        dtype_source = "checkpoint (no target config named)"
    model = _model(ckpt, getattr(torch, dtype_name))

    contracts: dict[str, str] = {}
    with staged_dir(out) as tmp:
        if to == "hf":
            model.save_pretrained(tmp, safe_serialization=True)
            with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            tensors = {}
        else:
            config = _serving_config(model, dtype_name)
            tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            contracts["sglang"] = check_export(config, shapes).summary()
            try:  # --to vllm must meet vLLM's contract; --to sglang says whether vLLM would load it too
                contracts["vllm"] = check_vllm_export(config, shapes)
            except ValueError:
                if to == "vllm":
                    raise
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        files = {n: file_sha256(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        provenance = {
            "format": EXPORT_FORMAT, "exporter": f"specforge-csbp {__version__}", "to": to,
            "source": {"path": os.path.abspath(ckpt.source), "sha256": file_sha256(ckpt.source),
                       "kind": ckpt.kind, "strategy": ckpt.strategy, "global_step": ckpt.global_step,
                       **ckpt.extra},
            "architecture": ckpt.architecture, "dtype": dtype_name, "dtype_source": dtype_source,
            "config": config, "files": files,
            **{f"{server}_contract": contracts.get(server) for server in ("sglang", "vllm")},
            "min_versions": ({k: v for k, v in server_floors(config).items() if k in contracts}
                             if contracts else None),
        }  # fmt: skip
        with open(os.path.join(tmp, PROVENANCE), "w", encoding="utf-8") as f:
            json.dump(provenance, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
    return ExportResult(
        out, ckpt.architecture, int(model.block_size), len(model.state_dict()), contracts.get(to), dtype_name,
        dtype_source, config, tuple(contracts),
    )  # fmt: skip


def load_exported(out: str):
    """The drafter in an export directory, as this project's model (config.json + weights, strict)."""
    ckpt = load_checkpoint(out)
    return _model(ckpt, next(iter(ckpt.state_dict.values())).dtype)


def serve_commands(
    draft_dir: str,
    config: dict,
    target: str = "<TARGET_MODEL>",
    servers: tuple[str, ...] = ("sglang", "vllm"),
) -> dict[str, str]:
    """The exact commands that serve `target` with the exported drafter, per server, with the floor release.

    SGLang: DFlash and DFlash2 both run under --speculative-algorithm DFLASH (the class comes from
    `architectures`); --speculative-num-draft-tokens is the trained block size.
    vLLM: method "dflash"; num_speculative_tokens counts the drafted tokens without the bonus token, and
    DFlash2's in-block convolution is built for 1 + num_speculative_tokens rows, so it is block_size - 1.
    A drafter that mixes sliding and full layers needs vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).
    """
    floors = server_floors(config)
    block = int((config.get("dflash_config") or {}).get("block_size", config.get("block_size")))
    types = set(config.get("layer_types") or ["full_attention"])
    spec = json.dumps({"method": "dflash", "model": draft_dir, "num_speculative_tokens": block - 1})
    v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if len(types) > 1 else ""
    commands = {
        "sglang": (
            f"# sglang>={floors['sglang']}\n"
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {draft_dir} --speculative-num-draft-tokens {block} --trust-remote-code"
        ),
        "vllm": f"# vllm>={floors['vllm']}\n{v2}vllm serve {target} --speculative-config '{spec}'",
    }
    return {server: commands[server] for server in servers}


def serve_command(draft_dir: str, block_size: int, target: str = "<TARGET_MODEL>") -> str:
    """SGLang's command to serve `target` with the exported drafter (DFlash and DFlash2 use DFLASH)."""
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {draft_dir} --speculative-num-draft-tokens {block_size} "
        "--trust-remote-code"
    )
