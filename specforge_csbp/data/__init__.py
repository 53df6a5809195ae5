"""Target-feature data for DFlash drafter training: the sharded feature store and how it is filled.

    manifest.py         StoreManifest / SampleEntry (pydantic), hashing, atomic JSON writes, target_info
    fingerprint.py      a target's weights in one digest (sampled values of every tensor): another fine-tune
                        of the same config is told apart from the one the features came from
    store.py            FeatureStoreWriter, FeatureStore (size-checked open, parallel positioned interval reads
                        verified per chunk), SampleRows (a sample's rows, whole or piece by piece)
    checksums.py        per-chunk checksums of a sample file's rows (xxh3_64 / crc32), header parse, positioned reads
    dataset.py          ShardedFeatureDataset: per rank, whole tokens + the rows of its zigzag intervals
    samples.py          jsonl chat/text samples -> input_ids, loss_mask (chat template, assistant mask)
    capture.py          TargetFeatures: a transformers target's hidden states at target_layer_ids
    specforge_import.py SpecForge 0.2.0 offline DFlash records -> store

See docs/feature_store.md.
"""

from .capture import TargetFeatures, check_target_layer_ids, load_target, random_target
from .dataset import ShardedFeatureDataset, ShardedSample
from .manifest import SampleEntry, StoreManifest, TargetInfo, config_hash
from .samples import has_consecutive_supervised, read_jsonl, tokenize_sample
from .specforge_import import import_specforge_records, list_specforge_records
from .store import VERIFY_MODES, FeatureStore, FeatureStoreWriter, SampleRows

__all__ = [
    "VERIFY_MODES",
    "FeatureStore",
    "FeatureStoreWriter",
    "SampleEntry",
    "SampleRows",
    "ShardedFeatureDataset",
    "ShardedSample",
    "StoreManifest",
    "TargetFeatures",
    "TargetInfo",
    "check_target_layer_ids",
    "config_hash",
    "has_consecutive_supervised",
    "import_specforge_records",
    "list_specforge_records",
    "load_target",
    "random_target",
    "read_jsonl",
    "tokenize_sample",
]
