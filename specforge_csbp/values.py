"""One parser per kind of value a user writes, shared by every flag and every config field.

    parse_size("64K") -> 65536        token counts and lengths: an integer with an optional K/M/G suffix
                                      (K = 1024), the same on a command line flag, in a YAML recipe and in an
                                      override (`data.max_length=64K`, `--max-length 64K`, `--contexts 64K,1M`)
    parse_sizes("4K,64K")             a comma-separated list of sizes (or a list of such strings)
    parse_ints("1,3,5")               a comma-separated list of integers (`--target-layer-ids`, `--world-sizes`);
                                      brackets as in the YAML spelling `[1, 3, 5]` are accepted too
    parse_override("[1, 2]")          the value of a `section.field=value` override, read as YAML reads the
                                      same text in a file, so a value the YAML accepts the override accepts
    size_arg("--max-length")          argparse `type=` for a size flag (one-line error naming the flag)
    size_field                        a pydantic size field's before-validator (training/config.py's `Size`)
    token_ids(value, "input_ids", where)   a record's token ids: a non-empty flat list of integers >= 0

Torch- and pydantic-free: the CLI parser uses it without starting torch, the benchmarks on machines without
pydantic.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["parse_ints", "parse_override", "parse_size", "parse_sizes", "size_arg", "size_field", "token_ids"]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KkMmGg]?)\s*")


def parse_size(value: Any, *, field: str = "context", minimum: int = 1) -> int:
    """'65536', '64K', '1M', '1.5K', 4096 -> tokens (K = 1024); the result must be a whole number >= `minimum`."""
    allowed = f"{field} must be an integer >= {minimum} with an optional K/M/G suffix (like 4096, 64K, 1M)"
    if isinstance(value, bool):
        raise ValueError(f"{allowed}; got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        scaled = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
        if not scaled.is_integer():
            raise ValueError(f"{allowed}; got {value!r} (not a whole number of tokens)")
        number = int(scaled)
    else:
        raise ValueError(f"{allowed}; got {value!r}")
    if number < minimum:
        raise ValueError(f"{allowed}; got {value!r}")
    return number


def parse_sizes(text: str | Sequence[str], *, field: str = "context") -> list[int]:
    """Comma-separated (or a list of) sizes, deduplicated and sorted."""
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in str(t).split(",")]
    return sorted({parse_size(t, field=field) for t in items if t.strip()})


def parse_ints(text: str, *, field: str, minimum: int = 0) -> list[int]:
    """'1,3,5' (or '[1, 3, 5]') -> [1, 3, 5] in the given order; every item an integer >= `minimum`."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    items = [t.strip() for t in body.split(",") if t.strip()]
    if not items or not all(re.fullmatch(r"-?\d+", t) for t in items) or min(int(t) for t in items) < minimum:
        raise ValueError(
            f"{field}: expected comma-separated integers >= {minimum} like 1,3,5; got {text!r}"
        )
    return [int(t) for t in items]


def parse_override(text: str) -> Any:
    """The value of `section.field=value`, parsed as the same text is in a YAML file (a string otherwise)."""
    import yaml  # lazy: only the config readers need it

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def size_arg(flag: str, *, minimum: int = 1) -> Callable[[str], int]:
    """argparse `type=` of a size flag: `--max-length 64K`; a bad value is argparse's one-line usage error."""

    def parse(text: str) -> int:
        try:
            return parse_size(text, field=flag, minimum=minimum)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{flag} ")) from None

    parse.__name__ = "size"  # argparse names the type in its message: "invalid size value"
    return parse


def token_ids(value: Any, field: str, where: str) -> list[int]:
    """`value` as token ids, or a one-line error naming `field` and `where` (file:line): a flat, non-empty
    list of integers >= 0 (no floats - 2.7 would become 2 -, no booleans, no nested lists)."""
    ok = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in value)  # fmt: skip
    if not ok:
        shown = repr(value)[:60]
        nested = " (a list of lists: give one prompt per record)" if isinstance(value, list) and any(
            isinstance(t, list) for t in value) else ""  # fmt: skip
        raise ValueError(
            f"{field}: {where} must be a non-empty list of non-negative integers (token ids){nested}; got {shown}"
        )
    return list(value)


def size_field(value: Any) -> Any:
    """A size field's value before its bounds: a string or float becomes tokens, anything else passes on."""
    # pydantic's error names the field and the value: only what is allowed is said here
    if isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            return parse_size(value, field="a size", minimum=0)
        except ValueError:
            raise ValueError("must be an integer with an optional K/M/G suffix (like 4096, 64K, 1M)") from None
    return value
