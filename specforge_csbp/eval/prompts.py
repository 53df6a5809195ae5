"""Prompts for `specforge-csbp eval`: token ids from a JSONL file or from a feature store's samples.

JSONL, one record a line, any of:
    {"input_ids": [...]}                      used as is
    {"text": "..."}                           tokenized with the target's tokenizer
    {"messages": [{"role", "content"}, ...]}  trailing assistant turns dropped, the target's chat template
                                              applied with the generation prompt (the model answers)
Feature store (data/store.py): each sample's tokens up to its first supervised token (the prompt of a
chat sample); a sample supervised from its first token (a document) is used whole. `split` picks held-out
samples: a store directory `STORE/<split>/` of its own, samples whose manifest entry carries
`split: <split>`, or the ids a manifest-level `splits: {<split>: [...]}` lists.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch

from ..compat import check_pair, store_side, target_side
from ..data.samples import check_messages
from ..data.split import eval_store_dir
from ..data.store import FeatureStore
from ..errors import read_jsonl
from ..values import token_ids

__all__ = ["jsonl_prompts", "store_prompts"]


def _tokenizer(target: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target)
    except Exception as err:  # noqa: BLE001 - any failure is the same one-line error
        raise ValueError(
            f"--prompts: text or chat records need the target's tokenizer, and {target} has none "
            f"({str(err).splitlines()[0][:120]}); give input_ids records instead"
        ) from None


def _ids(encoded) -> list[int]:
    if isinstance(encoded, Mapping):  # transformers 5 returns a BatchEncoding from apply_chat_template
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def _record_ids(record, where: str, tokenizer_of) -> list[int]:
    """Token ids of one prompt record (input_ids as is; text / messages through the target's tokenizer)."""
    if isinstance(record, dict) and "input_ids" in record:
        return token_ids(record["input_ids"], "--prompts", f"{where} input_ids")
    if not (isinstance(record, dict) and ("text" in record or "messages" in record)):
        raise ValueError(f"--prompts: {where} needs one of the fields input_ids, text, messages")
    if "text" in record and (not isinstance(record["text"], str) or not record["text"]):
        raise ValueError(f"--prompts: {where} text must be a non-empty string; got {record['text']!r:.60}")
    if "text" not in record:
        try:
            check_messages(record["messages"], where)
        except ValueError as err:
            raise ValueError(f"--prompts: {err}") from None
    tokenizer = tokenizer_of()
    if "text" in record:
        return _ids(tokenizer(str(record["text"]))["input_ids"])
    messages = list(record["messages"])
    while messages and messages[-1].get("role") == "assistant":
        messages.pop()
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def jsonl_prompts(path: str, target: str, limit: int | None = None) -> list[torch.Tensor]:
    prompts: list[torch.Tensor] = []
    tokenizer_of = functools.cache(lambda: _tokenizer(target))  # loaded on the first text / chat record
    for line_no, record in read_jsonl(path, "--prompts"):  # missing, a directory, not UTF-8 or JSON: one line
        if limit is not None and len(prompts) >= limit:
            break
        ids = _record_ids(record, f"{path}:{line_no}", tokenizer_of)
        if not ids:
            raise ValueError(f"--prompts: {path}:{line_no} is an empty prompt")
        prompts.append(torch.tensor(ids, dtype=torch.long))
    if not prompts:
        raise ValueError(f"--prompts: {path} has no records")
    return prompts


def _split_ids(store, root: str, split: str) -> list[str]:
    marked = [e.id for e in store.manifest.samples if getattr(e, "split", None) == split]
    if marked:
        return marked
    listed = (getattr(store.manifest, "splits", None) or {}).get(split)  # a manifest-level {name: [ids]}
    if listed:
        return [str(i) for i in listed]
    sibling = eval_store_dir(root)
    hint = f"; capture --eval-fraction wrote its held-out samples to {sibling}: give --store {sibling}" if (
        os.path.isdir(sibling)) else ""  # fmt: skip
    raise ValueError(
        f"--split: the store at {root} has no split {split!r} (neither {os.path.join(root, split)}/ "
        f"nor samples marked split={split!r}); leave --split out to use every sample{hint}"
    )


def store_prompts(
    root: str, split: str | None = None, limit: int | None = None, *, target: tuple[str, object] | None = None
) -> list[torch.Tensor]:
    """The store's prompts; `target` = (its --target path, its config): the store must have been captured
    from that target (compat.check_pair on the config hash and weights fingerprint the manifest records),
    checked before decoding."""
    if not os.path.exists(root):
        raise ValueError(f"--store: {root} does not exist")
    if not os.path.isdir(root):
        raise ValueError(f"--store: {root} is a file; give a feature store directory")
    if split is not None and os.path.isdir(os.path.join(root, split)):
        root, split = os.path.join(root, split), None
    store = FeatureStore(root, verify="trust")
    if target is not None:
        check_pair(store_side(f"--store {root}", store.manifest),
                   target_side(f"--target {target[0]}", target[1], target[0]),
                   advice="evaluate on prompts captured from this target, or give the store's target")  # fmt: skip
    ids = store.sample_ids if split is None else _split_ids(store, root, split)
    prompts = []
    for sample_id in ids[:limit]:
        tokens, mask = store.read_tokens(sample_id)
        supervised = torch.nonzero(mask).flatten()
        first = int(supervised[0]) if supervised.numel() else 0
        prompts.append(tokens[:first] if first > 0 else tokens)
    if not prompts:
        raise ValueError(f"--store: the store at {root} holds no samples")
    return prompts
