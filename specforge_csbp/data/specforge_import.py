"""Import SpecForge 0.2.0 offline DFlash records into a feature store.

What SpecForge writes (`scripts/prepare_hidden_states.py --strategy dflash`, DFlash's OfflineCaptureLayout
in `specforge/algorithms/dflash/providers.py`): one `torch.save`d dict per sample,

    OUT/rows_{g}-{g+2000}/data_{idx}.ckpt       (or .ckpt.gz: the same bytes through gzip)
        input_ids      [L]                       int64
        loss_mask      [L]                       int64
        hidden_states  [1, L, n_layers * hidden] target dtype; the SGLang capture of the draft config's
                                                 dflash_config.target_layer_ids, concatenated

and reads them back (`runtime/data_plane/offline_reader.py`) in sorted-path order, the sample at position i
being "offline:{i:08d}", normalized by `dflash_family_data.normalize_offline_sample` (squeeze the leading 1,
truncate to max_len). The records carry neither layer ids nor hidden size, so the caller supplies them
(from the draft config that drove the capture). Imported samples keep SpecForge's order and index: sample
id f"{i:08d}", source_file = the record's path relative to the source directory.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Callable, Sequence

import torch

from ..progress import progress_bar
from .manifest import FEATURE_DTYPES, StoreManifest, TargetInfo
from .store import FeatureStoreWriter

__all__ = ["import_specforge_records", "list_specforge_records", "load_specforge_record"]

_SUFFIXES = (".ckpt", ".ckpt.gz")


def list_specforge_records(src: str) -> list[str]:
    """Record files under `src` (or `src` itself), in the order SpecForge's reader assigns indices."""
    if os.path.isfile(src):
        return [os.path.abspath(src)]
    if not os.path.isdir(src):
        raise ValueError(f"src: {src} is neither a SpecForge record file nor a directory of them")
    files = [
        os.path.abspath(os.path.join(root, name))
        for root, _dirs, names in os.walk(src)
        for name in names
        if name.endswith(_SUFFIXES)
    ]
    files.sort()  # same ordering as specforge.runtime.data_plane.offline_reader.list_feature_files
    if not files:
        raise ValueError(f"src: no SpecForge records (*.ckpt, *.ckpt.gz) under {src}")
    return files


def load_specforge_record(path: str) -> dict[str, torch.Tensor]:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return torch.load(io.BytesIO(f.read()), weights_only=True)
        return torch.load(path, weights_only=True, mmap=True)
    except Exception as err:  # torch/gzip/pickle errors: name the file, one line
        raise ValueError(
            f"corrupted SpecForge record {path}: {type(err).__name__}: {err}".split("\n")[0]
        ) from None


def _one_row(t: torch.Tensor, name: str, path: str, dims: int) -> torch.Tensor:
    if t.dim() == dims + 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != dims:
        raise ValueError(f"{path}: {name} has shape {list(t.shape)}, expected {dims} dims (or a leading 1)")
    return t


def import_specforge_records(
    src: str,
    out: str,
    *,
    target_layer_ids: Sequence[int],
    hidden_size: int,
    target: TargetInfo,
    dtype: str | None = None,
    max_length: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    after_each: Callable[[str], None] | None = None,
) -> StoreManifest:
    """Convert every record under `src` into a store at `out`; returns its manifest. `after_each(path)` runs
    once a record's sample is stored (a caller short of disk deletes the record: one copy at a time)."""
    files = list_specforge_records(src)
    width = len(target_layer_ids) * hidden_size
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    src_root = src if os.path.isdir(src) else os.path.dirname(src)
    writer = None
    ok = False
    try:
        for index, path in enumerate(progress_bar(files, desc="import", unit="sample", disable=not progress)):
            ids, mask, hidden = _read_record(path, width, len(target_layer_ids), hidden_size, max_length)
            if writer is None:
                store_dtype = dtype or str(hidden.dtype).replace("torch.", "")
                if store_dtype not in FEATURE_DTYPES:
                    raise ValueError(f"dtype must be one of {', '.join(FEATURE_DTYPES)}; got {store_dtype!r}")
                writer = FeatureStoreWriter(
                    out, target=target, target_layer_ids=target_layer_ids, hidden_size=hidden_size,
                    dtype=store_dtype, source="specforge-import", overwrite=overwrite,
                )  # fmt: skip
            writer.add(f"{index:08d}", ids, mask, hidden, source_file=os.path.relpath(path, src_root))
            if after_each is not None:
                after_each(path)
        ok = True
    finally:
        if writer is not None and ok:
            writer.close()
        elif writer is not None and writer.manifest.samples:
            writer.close(complete=False)  # listed but marked incomplete: readers refuse it, --overwrite replaces it
        elif writer is not None:
            writer.discard()  # nothing converted: leave nothing
    return writer.manifest


def _read_record(path: str, width: int, n_layers: int, hidden_size: int, max_length: int | None):
    raw = load_specforge_record(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: holds a {type(raw).__name__}, not a DFlash record (a dict of tensors)")
    missing = [k for k in ("input_ids", "loss_mask", "hidden_states") if k not in raw]
    if missing:
        raise ValueError(
            f"{path}: missing DFlash record keys {missing} (was it captured with --strategy dflash?)"
        )
    ids = _one_row(raw["input_ids"], "input_ids", path, 1)[:max_length]
    mask = _one_row(raw["loss_mask"], "loss_mask", path, 1)[:max_length]
    hidden = _one_row(raw["hidden_states"], "hidden_states", path, 2)[:max_length]
    for name, t in (("input_ids", ids), ("loss_mask", mask)):
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"{path}: {name} has dtype {str(t.dtype).replace('torch.', '')}; it must hold integers")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{path}: loss_mask must hold only 0 and 1")
    if not hidden.is_floating_point():
        raise ValueError(f"{path}: hidden_states has dtype {str(hidden.dtype).replace('torch.', '')}; it must be float")
    if hidden.shape[1] != width:
        raise ValueError(
            f"{path}: feature width {hidden.shape[1]} != len(target_layer_ids) x hidden_size = "
            f"{n_layers} x {hidden_size} = {width}"
        )
    if not ids.shape[0] == mask.shape[0] == hidden.shape[0]:
        raise ValueError(
            f"{path}: lengths differ: input_ids {ids.shape[0]}, loss_mask {mask.shape[0]}, "
            f"hidden_states {hidden.shape[0]}"
        )
    return ids, mask, hidden
