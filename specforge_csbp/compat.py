"""One check for every pair of artifacts a command combines: do they belong together?

A command that combines two things the user names (a drafter and a target, a feature store and a target, an
eval store and a training store, an export's checkpoint and `--target`, a resumed store and the new flags)
reduces each to a `Side` - what its provenance says, under one name per fact - and calls `check_pair`
before any worker starts and before any decoding. The first fact that differs is the error, naming both
sides:

    --drafter d/ and --target t/ do not belong together: hidden_size is 32 in --drafter but 64 in --target
    (a drafter reads its target's hidden states and embeddings); ...

The facts are the provenance the project already writes: a target's config hash (data.manifest.config_hash,
recorded in every feature store) and the fingerprint of its weights (data/fingerprint.py: two targets of one
config - another fine-tune - are told apart; recorded in every feature store and, through it, in every
plugin checkpoint and export), the drafter config (hidden size, vocabulary, target depth, target layer
ids), a store's target layers and hidden size. A side that does not record a fact (a store imported
without a target config, a store or checkpoint written before fingerprints, a target given as a hub name)
leaves it out of the comparison.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .data.manifest import config_hash
from .errors import load_json

__all__ = [
    "WHY",
    "Side",
    "check_disjoint",
    "check_drafter_target",
    "check_not_a_drafter",
    "check_pair",
    "drafter_side",
    "looks_like_drafter",
    "read_target_config",
    "sample_identities",
    "store_side",
    "target_side",
]

#: why each fact must agree (the error says it)
WHY = {
    "hidden_size": "a drafter reads its target's hidden states and embeddings",
    "vocab_size": "the drafter uses the target's embeddings and LM head",
    "num_target_layers": "the drafter was built for a target of that depth",
    "target_layer_ids": "the drafter reads the hidden states of exactly these target layers",
    "target_config_sha256": "features, embeddings and LM head come from that target config",
    "target_weights_sha256": "features, embeddings and LM head come from those weights: the same config with "
    "other weights (another fine-tune or checkpoint) gives other hidden states",
}


@dataclass(frozen=True)
class Side:
    """One artifact of a pair: how the user named it (`--drafter PATH`) and the facts it records."""

    name: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The flag or field alone (`--drafter`, `data.hidden_states_path`), for the second mention."""
        return self.name.replace("=", " ").split(" ", 1)[0]


def check_pair(left: Side, right: Side, *, advice: str) -> None:
    """Raise for the first fact both sides record with different values."""
    for key, a in left.facts.items():
        if key not in right.facts or a is None or right.facts[key] is None:
            continue
        b = right.facts[key]
        if a != b:
            why = f" ({WHY[key]})" if key in WHY else ""
            shown_a, shown_b = (_short(key, a), _short(key, b)) if key.endswith("sha256") else (a, b)
            raise ValueError(
                f"{left.name} and {right.name} do not belong together: {key} is {shown_a} in {left.label} but "
                f"{shown_b} in {right.label}{why}; {advice}"
            )


def sample_identities(manifest) -> dict[str, str]:
    """identity -> sample id of a store's samples: the source record's hash where capture recorded it (the
    same record under any id), else the sample file's hash (the same features)."""
    return {(e.record_sha256 or e.sha256): e.id for e in manifest.samples}


def check_disjoint(left: Side, left_manifest, right: Side, right_manifest, *, advice: str) -> None:
    """Two stores that must not share a sample (held-out eval and training): the first shared one is the error."""
    a, b = sample_identities(left_manifest), sample_identities(right_manifest)
    shared = sorted(a.keys() & b.keys(), key=lambda k: a[k])
    if shared:
        raise ValueError(
            f"{left.name} and {right.name} share {len(shared)} sample(s) (first: {a[shared[0]]!r} in "
            f"{left.label}, {b[shared[0]]!r} in {right.label}); a held-out store must hold no training sample; "
            f"{advice}"
        )


def _short(key: str, digest: str) -> str:
    what = "weights fingerprint" if "weights" in key else "config sha256"
    return f"{what} {digest[:12]}"


def _text(config) -> Any:
    """The text model's config of a (possibly multimodal) target; a sub-config left as a plain dict by a
    config class that does not know it means the top level holds the text model's fields."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return config if isinstance(text, dict) else text


def target_side(name: str, config, path: str | None = None) -> Side:
    """A target model: its config (transformers) as the drafter and the stores see it; with `path` (its local
    directory) also the fingerprint of its weights (None for a hub name or a directory without safetensors)."""
    from .data.fingerprint import weights_fingerprint  # lazy: data/ starts torch

    text = _text(config)
    return Side(name, {
        "hidden_size": int(text.hidden_size), "vocab_size": int(text.vocab_size),
        "num_target_layers": int(text.num_hidden_layers), "target_config_sha256": config_hash(config),
        "target_weights_sha256": weights_fingerprint(path),
    })  # fmt: skip


def drafter_side(name: str, config, trained_for: Mapping[str, Any] | None = None) -> Side:
    """A drafter: its config (a DFlashConfig, or the config.json mapping) - the target facts it was built for;
    `trained_for`: the target facts its checkpoint records (DrafterCheckpoint.trained_for)."""
    side = _drafter_config_side(name, config)
    return Side(name, {**side.facts, **(trained_for or {})})


def _drafter_config_side(name: str, config) -> Side:
    if isinstance(config, Mapping):  # as written: top-level fields, dflash_config's layer ids
        dflash = config.get("dflash_config") or {}
        facts = {"hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size"),
                 "num_target_layers": config.get("num_target_layers"),
                 "target_layer_ids": dflash.get("target_layer_ids")}  # fmt: skip
        return Side(name, {k: (list(map(int, v)) if isinstance(v, list) else v) for k, v in facts.items()})
    return Side(name, {
        "hidden_size": int(config.hidden_size), "vocab_size": int(config.vocab_size),
        "num_target_layers": int(config.target_num_layers),
        "target_layer_ids": [int(i) for i in config.target_layer_ids],
    })  # fmt: skip


def store_side(name: str, manifest) -> Side:
    """A feature store: the target config it was captured from, its target layers and hidden size."""
    return Side(name, {
        "hidden_size": int(manifest.hidden_size), "target_layer_ids": list(manifest.target_layer_ids),
        "target_config_sha256": manifest.target.config_sha256,
        "target_weights_sha256": manifest.target.weights_sha256,
        "num_target_layers": manifest.target.num_hidden_layers,
    })  # fmt: skip


def looks_like_drafter(config: Mapping[str, Any] | Any) -> str | None:
    """The drafter architecture a config.json declares (DFlashDraftModel, ...), or None: a target named where
    a drafter belongs, or the reverse, is then named as swapped rather than failing later on something else."""
    data = config if isinstance(config, Mapping) else getattr(config, "__dict__", {})
    archs = data.get("architectures") or []
    found = [a for a in archs if isinstance(a, str) and "DFlash" in a]
    return found[0] if found else None


def check_not_a_drafter(path: str, field: str) -> None:
    """A target's path (a directory or its config.json) must not hold a drafter: swapped arguments are named
    as such, before a drafter config is read as a target and fails on something unrelated."""
    config_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return
    data = load_json(config_file, field)  # not UTF-8 or not JSON: a line naming the file and the line
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {config_file} must hold a JSON object (a model config)")  # noqa: TRY004
    arch = looks_like_drafter(data)
    if arch is not None:
        raise ValueError(
            f"{field}: {path} is a drafter ({arch}), not a target model; were the drafter and the target "
            "swapped? (the target is the model the drafter was trained for)"
        )


def read_target_config(path: str, field: str = "--target"):
    """A target model's transformers config, read before any weight: a missing path, a directory without a
    config, a drafter given as the target (swapped arguments) or an unreadable config is one line."""
    from transformers import AutoConfig  # lazy: heavy dependency, only for commands that read a target

    if not path or not os.path.exists(path):
        raise ValueError(f"{field}: {path} does not exist (give the target model's directory)")
    config_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{field}: {path} has no config.json; give the target model's directory")
    check_not_a_drafter(path, field)
    try:
        return AutoConfig.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    except Exception as err:  # noqa: BLE001 - any unreadable config is the same one-line error
        first = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        raise ValueError(f"{field}: {path} has no readable model config ({first})") from None


def check_drafter_target(
    drafter_config, target_config, drafter: str, target: str, *, trained_for: Mapping[str, Any] | None = None,
    target_path: str | None = None,
) -> None:  # fmt: skip
    """The drafter must read this target: the pair's facts agree (with `trained_for`, the checkpoint's record
    of its target, and `target_path`, the target's directory: also its config hash and weights), its target
    layers and mask token exist."""
    from .data.capture import check_target_layer_ids  # lazy: data.capture starts torch

    advice = "use the target the drafter was trained for, or a drafter trained for this target"
    check_pair(drafter_side(drafter, drafter_config, trained_for), target_side(target, target_config, target_path),
               advice=advice)  # fmt: skip
    text = _text(target_config)
    try:
        check_target_layer_ids(drafter_config.target_layer_ids, int(text.num_hidden_layers))
    except ValueError as err:
        raise ValueError(f"{drafter}: dflash_config.{err}") from None
    if not 0 <= int(drafter_config.mask_token_id) < int(text.vocab_size):
        raise ValueError(
            f"{drafter}: dflash_config.mask_token_id = {drafter_config.mask_token_id} is outside the vocabulary "
            f"0..{int(text.vocab_size) - 1} of {target}"
        )
