"""The feature store's manifest: one JSON file that describes every sample file and how to trust it.

    store/
      manifest.json               StoreManifest (this module)
      samples/00000000.safetensors  hidden_states [L, len(target_layer_ids) * hidden_size]  (store dtype)
      samples/00000001.safetensors  input_ids     [L] int64
      ...                           loss_mask     [L] int64

The manifest names the target (name, a hash of its config, a fingerprint of its weights), the target layer
ids whose hidden states are concatenated on each row, the hidden size and the feature dtype; per sample it
keeps the id, the relative file path, the length, the supervised-token count, the file size and its sha256,
and the per-chunk checksums of its rows (checksums.py; absent in stores written before them, which readers
check by sha256).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CHUNK_HASHES",
    "FEATURE_DTYPES",
    "FORMAT",
    "MANIFEST_NAME",
    "SampleEntry",
    "StoreManifest",
    "TargetInfo",
    "config_hash",
    "target_info",
]

FORMAT = "specforge-csbp-feature-store/1"
MANIFEST_NAME = "manifest.json"
FEATURE_DTYPES = ("bfloat16", "float16", "float32", "float64")
CHUNK_HASHES = ("xxh3_64", "crc32")  # checksums.py: the fast hash of each chunk of rows

# Fields of a transformers config that say nothing about the function the target computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}


class TargetInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="model path or hub name the features were captured from")
    config_sha256: str | None = Field(default=None, description="config_hash() of the target's config")
    weights_sha256: str | None = Field(
        default=None, description="weights_fingerprint() of the target's weights (data/fingerprint.py)"
    )
    random_init_seed: int | None = Field(default=None, description="set when the target had random weights")
    num_hidden_layers: int | None = None


class SampleEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    file: str = Field(description="path relative to the store root")
    length: int = Field(ge=1)
    num_loss_tokens: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    sha256: str
    source_file: str | None = Field(default=None, description="original record, for imported stores")
    first_anchor: int | None = Field(
        default=None, ge=0, description="first p with loss_mask[p] and loss_mask[p+1] (None: none, or not recorded)"
    )
    record_sha256: str | None = Field(
        default=None, description="sha256 of the source record and capture settings: --resume's sample identity"
    )
    chunk_digests: list[str] | None = Field(
        default=None, description="the store's chunk_hash of each chunk of chunk_rows hidden-state rows"
    )
    other_digest: str | None = Field(
        default=None, description="chunk_hash of every byte outside hidden_states (header, input_ids, loss_mask)"
    )


class StoreManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    target: TargetInfo
    target_layer_ids: list[int]
    hidden_size: int = Field(ge=1)
    dtype: str
    source: str = Field(default="capture", description="'capture' or 'specforge-import'")
    complete: bool = Field(
        default=True, description="false while a capture / import runs, and after one that stopped or failed"
    )
    chunk_hash: str | None = Field(default=None, description="hash of the per-chunk checksums (None: sha256 only)")
    chunk_rows: int | None = Field(default=None, ge=1, description="hidden-state rows per checksummed chunk")
    samples: list[SampleEntry] = []

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @model_validator(mode="after")
    def _check(self) -> StoreManifest:
        if self.format != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {self.format!r}")
        if self.dtype not in FEATURE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(FEATURE_DTYPES)}; got {self.dtype!r}")
        if not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be non-empty and unique, got {self.target_layer_ids}")
        if min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids must be >= 0, got {self.target_layer_ids}")
        if self.chunk_hash is not None and self.chunk_hash not in CHUNK_HASHES:
            raise ValueError(f"chunk_hash must be one of {', '.join(CHUNK_HASHES)}; got {self.chunk_hash!r}")
        if (self.chunk_hash is None) != (self.chunk_rows is None):
            raise ValueError("chunk_hash and chunk_rows: give both or neither")
        ids = [s.id for s in self.samples]
        if len(set(ids)) != len(ids):
            raise ValueError("samples: sample ids must be unique")
        return self


def config_hash(config: Any) -> str:
    """sha256 of a transformers config (or dict) as canonical JSON, without volatile fields."""
    data = config if isinstance(config, dict) else config.to_dict()
    data = {k: v for k, v in data.items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def target_info(path: str, config: Any) -> TargetInfo:
    """What a store records of the local target at `path` with transformers config `config`: its path, config
    hash, depth and weights fingerprint (fingerprint.py; None for a directory without safetensors weights)."""
    import os

    from .fingerprint import weights_fingerprint  # lazy: reads the target's weight files

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return TargetInfo(
        name=os.path.abspath(path), config_sha256=config_hash(config),
        weights_sha256=weights_fingerprint(path), num_hidden_layers=int(text.num_hidden_layers),
    )  # fmt: skip
