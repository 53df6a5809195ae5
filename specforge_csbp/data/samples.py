"""jsonl samples -> (input_ids, loss_mask) with the tokenizer's own chat template.

Two sample kinds, one per line:
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
        rendered by tokenizer.apply_chat_template; loss mask = assistant turns (content + end-of-turn token)
    {"text": "..."}
        tokenized as is (with the tokenizer's special tokens); loss mask = every token
    {"input_ids": [...]}
        token ids used as they are (synthetic documents, pre-tokenized data); loss mask = every token
An optional "id" field names the sample in the store (default: the line number, 8 digits).

The assistant mask comes from transformers' `return_assistant_tokens_mask` when the template marks assistant
output with {% generation %} (the bundled tiny tokenizer does). Most released templates (Qwen3, Llama 3) do
not, so otherwise the rendered text is searched, message by message in order, for each assistant content,
and the tokens overlapping it plus the one token after it (the end-of-turn token: <|im_end|>, <|eot_id|>)
are supervised - the same span SpecForge's template regexes select.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from .. import errors
from ..values import token_ids

__all__ = ["check_messages", "has_consecutive_supervised", "read_jsonl", "sample_id_of", "tokenize_sample"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def read_jsonl(path: str, field: str = "data") -> Iterator[tuple[int, dict]]:
    """(line_number, record) for every non-empty line (0-based); a bad line - not UTF-8, not JSON, not an
    object - is a one-line ValueError naming the file and the line."""
    for n, record in errors.read_jsonl(path, field):
        if not isinstance(record, dict):
            raise ValueError(f"{field}: line {n} of {path} must be a JSON object")
        yield n - 1, record


def sample_id_of(line: int, record: dict) -> str:
    sid = record.get("id")
    return str(sid) if isinstance(sid, (str, int)) and str(sid) else f"{line:08d}"


def check_messages(messages: Any, where: str) -> None:
    """A chat record's `messages`: a non-empty list of {role, content} objects (one line otherwise)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: {where} must be a non-empty list of {{'role', 'content'}} objects")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages: {where} has an entry without a 'role'")


def _chat_generation_mask(tokenizer, messages: list) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def _chat_search_mask(tokenizer, messages: list, where: str) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    spans, cursor = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str) or not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            if m["role"] == "assistant":
                raise ValueError(
                    f"messages: {where}: an assistant message does not appear verbatim in the rendered chat "
                    "template; use a template with {% generation %} markers"
                )
            continue  # the template rewrote a non-assistant message (e.g. a system default); not supervised
        if m["role"] == "assistant":
            spans.append((at, at + len(content)))
        cursor = at + len(content)
    mask = [0] * len(ids)
    for lo, hi in spans:
        last = -1
        for t, (a, b) in enumerate(offsets):
            if b > lo and a < hi:
                mask[t], last = 1, t
        if 0 <= last < len(ids) - 1:
            mask[last + 1] = 1  # the end-of-turn token that closes the answer
    return ids, mask


def tokenize_sample(
    tokenizer, record: dict, *, max_length: int, where: str = "sample"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [L], loss_mask [L]) int64 for one record, truncated to the first `max_length` tokens."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if sum(k in record for k in ("messages", "text", "input_ids")) != 1:
        raise ValueError(
            f"data: {where} needs exactly one of 'messages' (chat) or 'text' (or 'input_ids'), got keys {sorted(record)}"
        )
    if "input_ids" in record:
        ids = token_ids(record["input_ids"], "input_ids", where)
        mask = [1] * len(ids)
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError(f"text: {where} must be a string")
        ids = list(tokenizer(record["text"], add_special_tokens=True)["input_ids"])
        mask = [1] * len(ids)
    else:
        messages = record["messages"]
        check_messages(messages, where)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer: has no chat_template, so chat samples cannot be rendered")
        template = tokenizer.chat_template
        if isinstance(template, str) and _GENERATION_TAG.search(template):
            ids, mask = _chat_generation_mask(tokenizer, messages)
        else:
            ids, mask = _chat_search_mask(tokenizer, messages, where)
    ids, mask = ids[:max_length], mask[:max_length]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64)


def has_consecutive_supervised(loss_mask: torch.Tensor) -> bool:
    """DFlash needs an anchor and its next token supervised; samples without such a pair teach nothing."""
    m = loss_mask.bool()
    return bool((m[:-1] & m[1:]).any()) if m.numel() > 1 else False
