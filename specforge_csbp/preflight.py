"""Up-front checks shared by every entry point: what can be known before a process starts, a model loads
or a step runs is checked here, once, with one line naming the field and what is allowed.

    check_writable_dir      an output directory: not a file, no file on its path, writable (created later)
    check_writable_file     an output file: not a directory, its directory writable - before the work that
                            fills it (an eval's decoding, an export, a report)
    check_weights_dir       a from_pretrained directory meant to be loaded with its weights: weights files
                            present and none of them empty
    check_finite_tensors    loaded weights: no NaN / inf, naming the tensor and the file (eval, export, warm
                            start, resume)
    count_non_finite        NaN / inf in one tensor at memory speed (the store's features, loaded weights)
    check_input_file        an input that must be a file (not a directory, present); errors.py's readers
                            check every file they read with it
    check_finite            every float of a config (nested dicts/lists): no NaN, no +-inf
    check_store_trainable   every feature-store sample keeps a DFlash anchor within data.max_length
    check_outside           an output that must not live inside a directory another process rotates

Used by `capture`, `import-specforge`, `export`, `eval`, `report`, `sweep`, the scenarios, `train-bdlm`
(models/bdlm/recipe.py `preflight`, training/validate.py) and the drafter launcher (plugin/launch.py
`preflight`), so the same mistake gets the same message everywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "check_finite",
    "check_finite_tensors",
    "check_flex_backend_on_cpu",
    "check_input_file",
    "check_local_path",
    "check_outside",
    "check_store_trainable",
    "check_weights_dir",
    "check_writable_dir",
    "check_writable_file",
    "count_non_finite",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def check_writable_dir(path: str | os.PathLike, field: str) -> None:
    """Raise unless `path` is, or can be created as, a writable directory. Creates nothing."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{field}: {path} is a file; it must be a directory (created when missing)")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"{field}: {path} cannot be created: {probe} is a file, not a directory")
    if not _can_create_in(probe):
        what = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise ValueError(f"{field}: {path} {what}; choose a directory this user can write")


def _can_create_in(directory: str) -> bool:
    """Whether a file can be created in `directory`, found by creating (and removing) one: permission bits
    say nothing for root, a read-only mount or a pseudo file system such as /proc."""
    import tempfile

    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def check_writable_file(path: str | os.PathLike, field: str, *, must_exist_dir: bool = True) -> None:
    """Raise unless a file can be written at `path`: not a directory, its directory present (or, with
    `must_exist_dir=False`, creatable) and writable. Creates nothing."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{field}: {path} is a directory; give a file name")
    parent = os.path.dirname(path)
    if must_exist_dir and not os.path.isdir(parent):
        what = "is a file" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{field}: the directory {parent} {what}; create it or choose another path")
    check_writable_dir(parent, field)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{field}: {path} is not writable; choose a file this user can write")


def check_weights_dir(path: str | os.PathLike, field: str) -> None:
    """A local from_pretrained directory must hold weights files, none of them empty (a zero-byte or missing
    weights file otherwise surfaces as a rank's transformers message naming neither the file nor the field)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return  # a hub name, or a missing path (check_local_path's error)
    files = sorted(n for n in os.listdir(path) if n.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise ValueError(
            f"{field}: {path} has no weights (no *.safetensors or *.bin file; only a config?); give a "
            "save_pretrained directory with its weights, or model.config for random weights"
        )
    for name in files:
        if os.path.getsize(os.path.join(path, name)) == 0:
            raise ValueError(f"{field}: {os.path.join(path, name)} is empty (0 bytes); re-copy or re-save the weights")


def count_non_finite(tensor) -> int:
    """How many NaN / inf values a tensor holds (0 for integer tensors).

    One min/max pass decides (NaN propagates into both, an inf lands in one): on CPU that is ~60x faster than
    an elementwise isfinite mask, which made the check the slowest part of writing a 64K sample of features.
    The exact count, for the error message, is taken only when that pass finds something."""
    import torch  # here, not at the top: the launcher's checks run before torch is loaded

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    low, high = torch.aminmax(tensor.detach())
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return 0
    return int((~torch.isfinite(tensor.detach())).sum())


def check_finite_tensors(tensors, field: str, source: str | os.PathLike) -> None:
    """Raise for the first tensor of `tensors` (a name -> tensor mapping) holding NaN or inf: a drafter with
    one non-finite weight would evaluate, export and train on as if nothing were wrong."""
    for name, tensor in tensors.items():
        if not hasattr(tensor, "is_floating_point"):  # not a tensor (e.g. metadata in a state dict)
            continue
        count = count_non_finite(tensor)
        if count:
            raise ValueError(
                f"{field}: {source}: tensor {name!r} has {count} non-finite value(s) (NaN or inf) of "
                f"{tensor.numel()}; these weights cannot be used - take an earlier checkpoint"
            )


def check_input_file(path: str | os.PathLike, field: str) -> str:
    """`path` as a string; one-line error when it is missing or a directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{field}: {path} is a directory; give a file")
    if not os.path.isfile(path):
        raise ValueError(f"{field}: {path} does not exist")
    return path


def check_local_path(path: str | None, field: str) -> None:
    """A value that is written as a local path (absolute, ./, ../, ~) must exist; hub names ("org/name") pass."""
    if not path or not str(path).startswith(("/", "./", "../", "~", "file://")):
        return
    local = os.path.expanduser(str(path).removeprefix("file://"))
    if not os.path.exists(local):
        raise ValueError(f"{field}: {path} does not exist (a local path; a hub model is written as org/name)")


def check_finite(data: Any, prefix: str = "") -> None:
    """Raise for the first float in `data` (a nested mapping / sequence) that is NaN or infinite."""
    if isinstance(data, float):
        if not math.isfinite(data):
            raise ValueError(f"{prefix or 'value'}: {data} is not a finite number; give a finite value")
    elif isinstance(data, Mapping):
        for key, value in data.items():
            check_finite(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        for i, value in enumerate(data):
            check_finite(value, f"{prefix}[{i}]")


def _first_anchor(loss_mask) -> int | None:
    m = loss_mask.reshape(-1) > 0
    hits = (m[:-1] & m[1:]).nonzero()
    return int(hits[0]) if hits.numel() else None


def check_store_trainable(store, max_length: int, field: str = "data.max_length") -> None:
    """Every sample of `store` (a FeatureStore) must keep a valid DFlash anchor (two consecutive supervised
    tokens) within its first `max_length` tokens, or the run fails when the sampler reaches it. Uses the
    manifest's `first_anchor` where it is recorded; reads the (small) token tensors otherwise."""
    bad: list[tuple[str, int | None]] = []
    for entry in store.manifest.samples:
        if entry.num_loss_tokens < 2:
            continue  # never sampled: the reader filters samples with fewer than 2 supervised tokens
        first = entry.first_anchor
        if first is None:
            first = _first_anchor(store.read_tokens(entry.id)[1])
        if first is None or first + 2 > max_length:
            bad.append((entry.id, first))
    if bad:
        sid, first = bad[0]
        need = f"; data.max_length >= {first + 2} keeps it" if first is not None else ""
        raise ValueError(
            f"{field}: {len(bad)} of {len(store)} samples of the feature store {store.root} have no two "
            f"consecutive supervised tokens within {field}={max_length} (first: sample {sid!r}{need}); raise "
            f"{field} or capture the store with --max-length {max_length}"
        )


def check_outside(out: str | os.PathLike, field: str, rotated: str | os.PathLike, why: str) -> None:
    """Raise when `out` is `rotated` or inside it (e.g. an export written into a checkpoint directory that
    the trainer's checkpoint rotation deletes)."""
    out_abs = os.path.realpath(os.fspath(out))
    root = os.path.realpath(os.fspath(rotated))
    if out_abs == root or out_abs.startswith(root.rstrip(os.sep) + os.sep):
        raise ValueError(f"{field}: {out} is inside {rotated}, {why}; write it outside that directory")


def check_flex_backend_on_cpu(field: str, backend: str, flex: str, *, where: str, allowed: str) -> None:
    """A run on the CPU that asks for FlexAttention (`backend == flex`, the entry point's name for it) stops
    before any worker starts: FlexAttention has no backward on the CPU. `where` says why this run is on the
    CPU, `allowed` the backends that are."""
    if backend == flex:
        raise ValueError(
            f"{field}={backend}: FlexAttention trains on GPUs only (no backward on the CPU) and {where}; "
            f"allowed here: {allowed}"
        )
