"""A target's weights in one digest, read from a few values of every tensor.

Two targets of one config - another fine-tune, another checkpoint of the same run, base and instruct - have
the same config hash but give other hidden states, embeddings and LM head, so a drafter or a feature store of
one is meaningless with the other. Hashing every shard of a 27B target would read 54 GB at each launch; this
reads `PROBES` evenly spaced rows of each tensor, at most `PROBE_VALUES` values of each (the safetensors
library's lazy slices: a few KiB per tensor):

    tensor [rows, ...]   row 0        row r/3        row 2r/3      row r-1
                         |#####.....| |#####.....|   |#####.....|  |#####.....|   # = the values hashed

    digest = sha256 over every tensor, in name order across all *.safetensors files of the directory:
             name, shape, and the probed values as bfloat16

Training changes essentially every value of a tensor it updates, so any other weights change the digest;
the values are hashed as bfloat16, so the same weights saved in float32, bfloat16 or float16 (or resharded)
give the same digest. A spot check for mixed-up artifacts, not a defence against a forger (the store's
per-file sha256 is that). A directory without safetensors files (a config alone: a random-weight target,
recorded by its seed instead; `.bin` weights) has no fingerprint: None, and the checks that use it are
skipped.

    weights_fingerprint(path)   -> hex digest, or None
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os

import torch

__all__ = ["PROBES", "PROBE_VALUES", "weights_fingerprint"]

#: rows probed per tensor (first, last and evenly spaced between them)
PROBES = 4
#: values read from each probed row (its first ones): enough that a changed tensor changes the digest
PROBE_VALUES = 256


def _probe(f, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The probed values of tensor `name` of the open safetensors file `f`, flattened (lazy slices: only
    those values are read)."""
    if len(shape) == 0 or 0 in shape:
        return f.get_tensor(name).reshape(-1)
    view, rows = f.get_slice(name), shape[0]
    picks = sorted({(k * (rows - 1)) // max(PROBES - 1, 1) for k in range(PROBES)})
    if len(shape) == 1:
        starts = sorted({min(row, max(rows - PROBE_VALUES, 0)) for row in picks})
        parts = [view[lo : lo + PROBE_VALUES] for lo in starts]
    else:
        parts = [view[row : row + 1, : min(shape[1], PROBE_VALUES)] for row in picks]
    return torch.cat([p.reshape(-1) for p in parts])


def weights_fingerprint(path: str | None) -> str | None:
    """The fingerprint of the weights in directory `path` (see the module docstring), or None where it has no
    safetensors weights (or is not a local directory: a hub name)."""
    if not path or not os.path.isdir(path):
        return None
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open  # lazy: only commands that compare targets read weights

    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        where: dict[str, tuple[object, tuple[int, ...]]] = {}
        for file in files:
            try:
                f = stack.enter_context(safe_open(file, framework="pt"))
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    where[name] = (f, tuple(f.get_slice(name).get_shape()))
            except Exception as err:  # noqa: BLE001 - any unreadable weight file is the same one-line error
                raise ValueError(f"target weights: {file} is not a readable safetensors file ({err})") from None
        for name in sorted(where):
            f, shape = where[name]
            values = _probe(f, name, shape)
            digest.update(json.dumps([name, list(shape)]).encode())
            if values.is_floating_point():
                values = values.to(torch.bfloat16).view(torch.int16)
            digest.update(values.contiguous().numpy().tobytes())
    return digest.hexdigest()
