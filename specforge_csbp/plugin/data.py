"""SpecForge's offline data path, pointed at this project's feature store.

SpecForge's loader materialises whole feature files on every rank; a CSBP rank must read only its zigzag
rows. So what travels through SpecForge's data plane is only a sample *index*: each `SampleRef` names one
entry of a tiny index file (written once per process into a temporary directory), the loader delivers
`sample_index` tensors, and the training model reads the rank's rows from the store itself.

    data.hidden_states_path = <feature store>        manifest.json + samples/*.safetensors
        StoreIndexReader.read()  -> SampleRef(file://<tmp>/index.pt, key "s000000012")   x N
        index.pt holds one `StoreIndexKeys` (a mask over the store's samples): SpecForge torch.loads the
        file once per sample, so its load costs the same whatever the store's size, and a key's
        tensor([12]) is made when SpecForge looks it up
        SpecForge shards the refs over all ranks (DistributedSampler order), loads, collates:
        TrainBatch.tensors["sample_index"] = [12, 40, ...]    (batch_size per rank)
        training_model.py gathers a CP group's indices and trains every gathered sample, sharded.

A directory of SpecForge offline records (`*.ckpt`, no manifest.json) is refused with the converter's
command (`specforge-csbp import-specforge`), as is anything else that is not a store.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from functools import partial

import torch

from ..data.manifest import MANIFEST_NAME
from ..data.store import FeatureStore

__all__ = [
    "FEATURE",
    "NORMALIZER_ID",
    "STORAGE_FORMAT",
    "StoreIndexKeys",
    "StoreIndexReader",
    "build_collator",
    "build_normalizer",
    "build_reader",
    "check_store_path",
]

FEATURE = "sample_index"
NORMALIZER_ID = "csbp_sample_index_v1"
STORAGE_FORMAT = "specforge_csbp_feature_store_v1"
INDEX_FILE = "index.pt"


def check_store_path(path: str, field: str = "data.hidden_states_path") -> None:
    """One-line ValueError naming `field` (data.hidden_states_path or data.eval_hidden_states_path) unless
    `path` is a feature store."""
    if not path:
        raise ValueError(f"{field}: empty; CSBP strategies train from a feature store")
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return
    if os.path.isdir(path) and any(
        n.endswith((".ckpt", ".ckpt.gz")) for _, _, ns in os.walk(path) for n in ns
    ):
        raise ValueError(
            f"{field}={path} holds SpecForge offline records, not a CSBP feature store; convert "
            f"once with `specforge-csbp import-specforge {path} OUT` and point {field} at OUT"
        )
    hint = "fill one with `specforge-csbp capture`"
    if field != "data.hidden_states_path":
        hint += " --eval-fraction F (it writes OUT-eval)"
    raise ValueError(f"{field}={path} is not a feature store (no {MANIFEST_NAME}); {hint}")


class StoreIndexKeys:
    """The object an index file holds: key `StoreIndexReader.key(i)` -> tensor([i]) for every trained store
    index i, made on lookup. SpecForge loads a ref's file once per sample (`torch.load`, then
    `raw[key]`); a dict of one tensor per sample would unpickle every sample's tensor at each load (about
    20 ms per sample at 512 samples, the data wait of a batch of short samples), this unpickles one mask."""

    def __init__(self, trained: torch.Tensor) -> None:
        self.trained = trained  # [store samples] bool: which store indices the run trains

    def _index(self, key: object) -> int | None:
        if not (isinstance(key, str) and key.startswith("s") and key[1:].isdigit()):
            return None
        index = int(key[1:])
        return index if index < self.trained.numel() and bool(self.trained[index]) else None

    def __contains__(self, key: object) -> bool:
        return self._index(key) is not None

    def __getitem__(self, key: str) -> torch.Tensor:
        index = self._index(key)
        if index is None:
            raise KeyError(key)
        return torch.tensor([index], dtype=torch.long)


class StoreIndexReader:
    """`OfflineDataProvider.build_reader` product: one metadata-only SampleRef per store sample."""

    def __init__(self, strategy: str, hidden_states_path: str, *, run_id: str, ttt_length: int, max_len: int):
        check_store_path(hidden_states_path)
        self.strategy, self.run_id, self.max_len = strategy, run_id, max_len
        self.store = FeatureStore(hidden_states_path, verify="trust")
        # samples with fewer than 2 supervised tokens have no anchor; SpecForge filters them the same way
        self.indices = [i for i, s in enumerate(self.store.manifest.samples) if s.num_loss_tokens >= 2]
        if not self.indices:
            raise ValueError(
                f"data.hidden_states_path={hidden_states_path}: no sample has 2 supervised tokens"
            )
        self._dir = tempfile.mkdtemp(prefix="specforge-csbp-index-")
        atexit.register(shutil.rmtree, self._dir, True)
        trained = torch.zeros(len(self.store.manifest.samples), dtype=torch.bool)
        trained[self.indices] = True
        self._file = os.path.join(self._dir, INDEX_FILE)
        torch.save(StoreIndexKeys(trained), self._file)

    @staticmethod
    def key(index: int) -> str:
        return f"s{index:09d}"

    def read(self, limit: int | None = None):
        from specforge.runtime.contracts import SCHEMA_VERSION, SampleRef

        target = self.store.manifest.target.name
        refs = []
        for index in self.indices[:limit] if limit is not None else self.indices:
            entry = self.store.manifest.samples[index]
            ref = SampleRef(
                sample_id=f"{self.run_id}:{index:08d}", run_id=self.run_id, source_task_id=None,
                feature_store_uri=f"file://{self._file}", feature_keys={FEATURE: self.key(index)},
                feature_specs={}, strategy=self.strategy, schema_version=SCHEMA_VERSION,
                target_model_version=target, num_tokens=min(entry.length, self.max_len),
                metadata={"format": STORAGE_FORMAT, "target_repr": None, "store_sample_id": entry.id},
            )  # fmt: skip
            refs.append(ref)
        return refs

    def __iter__(self):
        return iter(self.read())


def build_reader(strategy: str, hidden_states_path: str, *, run_id: str, ttt_length: int, max_len: int):
    return StoreIndexReader(
        strategy, hidden_states_path, run_id=run_id, ttt_length=ttt_length, max_len=max_len
    )


def _normalize(raw: dict, **_unused) -> dict:
    index = raw[FEATURE].reshape(-1)
    if index.numel() != 1:
        raise ValueError(f"{FEATURE}: expected one index per sample, got {index.numel()}")
    return {FEATURE: index.to(torch.long)}


def build_normalizer(max_len: int, **_topology):
    return partial(_normalize, max_len=max_len)


def _collate(features: list[dict]) -> dict:
    return {FEATURE: torch.cat([f[FEATURE] for f in features])}


def build_collator():
    return _collate
