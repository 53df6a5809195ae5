"""Write an exported drafter directory (`--to sglang` or `--to hf`) with its provenance.

    OUT/
      config.json          the drafter config (SGLang's fields; `--to sglang` checks them like SGLang does)
      model.safetensors    drafter weights under SGLang's names (q/k/v and gate/up unfused: SGLang fuses)
      provenance.json      source checkpoint path + sha256, strategy, step, config, objective, file hashes

Both targets hold the same tensors; `--to hf` is `save_pretrained` (loadable with
`specforge_csbp.models.dflash.DFlash2DraftModel.from_pretrained(OUT)`), `--to sglang` is additionally
checked against SGLang's loader contract (export/sglang_contract.py) and fails instead of writing a directory
SGLang would load with silently missing weights. The directory is written next to OUT and renamed into
place, so OUT is either complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from .checkpoint import DrafterCheckpoint, load_checkpoint, sha256_file

__all__ = ["EXPORT_FORMAT", "TARGETS", "ExportResult", "export_drafter", "load_exported", "serve_command"]

EXPORT_FORMAT = "specforge-csbp-export/1"
TARGETS = ("sglang", "hf")
_DTYPES = ("float32", "bfloat16", "float16")
PROVENANCE = "provenance.json"


@dataclass
class ExportResult:
    out: str
    architecture: str
    block_size: int
    num_tensors: int
    contract: str | None  # the SGLang loader-contract summary (sglang only)


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
    from ..models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

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


def export_drafter(
    checkpoint: str, out: str, *, to: str = "sglang", overwrite: bool = False, dtype: str | None = None
) -> ExportResult:
    from safetensors.torch import save_file

    from .. import __version__
    from .sglang_contract import check_export

    if to not in TARGETS:
        raise ValueError(f"--to must be one of {', '.join(TARGETS)}; got {to!r}")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    _check_out(out, overwrite)
    ckpt = load_checkpoint(checkpoint)
    source_dtype = next(iter(ckpt.state_dict.values())).dtype
    target = getattr(torch, dtype) if dtype else source_dtype
    model = _model(ckpt, target)
    dtype_name = str(target).replace("torch.", "")

    tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        contract = None
        if to == "hf":
            model.save_pretrained(tmp, safe_serialization=True)
            with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            tensors = {}
        else:
            config = _serving_config(model, dtype_name)
            tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            report = check_export(config, {k: tuple(v.shape) for k, v in tensors.items()})
            contract = report.summary()
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        files = {n: sha256_file(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        provenance = {
            "format": EXPORT_FORMAT, "exporter": f"specforge-csbp {__version__}", "to": to,
            "source": {"path": os.path.abspath(ckpt.source), "sha256": sha256_file(ckpt.source),
                       "kind": ckpt.kind, "strategy": ckpt.strategy, "global_step": ckpt.global_step,
                       **ckpt.extra},
            "architecture": ckpt.architecture, "dtype": dtype_name, "config": config, "files": files,
            "sglang_contract": contract,
        }  # fmt: skip
        with open(os.path.join(tmp, PROVENANCE), "w", encoding="utf-8") as f:
            json.dump(provenance, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, ckpt.architecture, int(model.block_size), len(model.state_dict()), contract)


def load_exported(out: str):
    """The drafter in an export directory, as this project's model (config.json + weights, strict)."""
    from .checkpoint import load_checkpoint

    ckpt = load_checkpoint(out)
    return _model(ckpt, next(iter(ckpt.state_dict.values())).dtype)


def serve_command(draft_dir: str, block_size: int, target: str = "<TARGET_MODEL>") -> str:
    """SGLang's command to serve `target` with the exported drafter (DFlash and DFlash2 use DFLASH)."""
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {draft_dir} --speculative-num-draft-tokens {block_size} "
        "--trust-remote-code"
    )
