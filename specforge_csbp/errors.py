"""One formatter for the errors a user can cause, and readers that say where a file is bad.

Every `specforge-csbp` entry point (cli/main.py, the drafter launcher and its workers) turns an exception
into the one line it prints with `one_line`:

    ValueError / pydantic ValidationError   the message, or the first pydantic error as `loc: msg`
    OSError (ENOSPC, EACCES, ENOENT, ...)    `cannot write FILE: No space left on device (disk full) ...`
    yaml / json / UTF-8 decode errors         `FILE:LINE:COL ...` (readers below add the file)
    safetensors errors                        `FILE: not a complete safetensors file (...)`

`is_disk_full` says whether a failed write ran out of space (ENOSPC, a library's wording, torch.save's
zip-writer short write into a nearly full directory); outputs.naming_full_disk turns it into one OSError.
`is_user_error` says which exceptions are the user's (printed as one line, exit 2) and which are bugs
(tracebacks); a `RunFault` (out of device memory, a non-finite loss) is the user's too: the recipe or the
machine changes it, and its message names the ranks and what to change. The readers are what every entry point uses to read a user's text file: a missing file, a
directory, non-UTF-8 bytes, bad JSON or YAML all become a one-line ValueError naming the field, the file and
the line:

    read_text     the whole file as UTF-8              read_lines   (line number, text), streamed
    load_json     one JSON document                    read_jsonl   (line number, value) per non-blank line
    load_yaml     one YAML document                    load_config  YAML for .yaml / .yml, else JSON
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic is imported only where a ValidationError is formatted
    from pydantic import ValidationError

from .preflight import check_input_file

__all__ = [
    "RunFault",
    "allocation_size",
    "format_validation_error",
    "is_disk_full",
    "is_out_of_memory",
    "is_user_error",
    "load_config",
    "load_json",
    "load_yaml",
    "one_line",
    "read_jsonl",
    "read_lines",
    "read_text",
]


class RunFault(RuntimeError):
    """A fault a run meets that the user resolves by changing the recipe or the machine, not a bug: one line,
    no traceback. Raised on every rank of the job at once (the ranks agree on it in a collective), and its
    message names the ranks involved, so launchers print it without a `rank r:` prefix."""


_DISK_FULL = ("No space left on device", "StorageFull", "Disk quota exceeded")
# a short write of a writer that does not pass the errno on (torch.save's zip writer: "[enforce fail at
# inline_container.cc:...] . unexpected pos N vs M"); a full disk when the directory has next to no space left
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing file", "file write failed")
_NEARLY_FULL_BYTES = 64 << 20
# an accelerator allocation that failed (torch.OutOfMemoryError's wording, cuBLAS / cuDNN workspaces)
_OUT_OF_MEMORY = ("CUDA out of memory", "out of device memory", "CUBLAS_STATUS_ALLOC_FAILED",
                  "CUDNN_STATUS_ALLOC_FAILED", "HIP out of memory")  # fmt: skip


def is_out_of_memory(err: BaseException) -> bool:
    """The device ran out of memory (torch.OutOfMemoryError, or an allocation failure inside a library)."""
    return type(err).__name__ == "OutOfMemoryError" or any(m in str(err) for m in _OUT_OF_MEMORY)


def is_disk_full(err: BaseException, directory: str | os.PathLike | None = None) -> bool:
    """`err` is a write that failed for lack of space: ENOSPC / EDQUOT, a library's wording of it, or a short
    write (torch's zip writer) into `directory` while it has under 64 MiB free. Call it before a failed
    write's partial file is removed (afterwards the space is back)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if any(m in text for m in _DISK_FULL):
        return True
    if directory is None or not any(m in text for m in _SHORT_WRITE):
        return False
    try:
        return os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize < _NEARLY_FULL_BYTES
    except OSError:
        return False


def allocation_size(err: BaseException | str) -> str | None:
    """The size an out-of-memory error says it tried to allocate ('2.00 GiB'), from torch's message."""
    tried = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMGT]?i?B)", str(err))
    return tried.group(1) if tried else None


def _out_of_memory(err: BaseException) -> str:
    """'device out of memory (tried to allocate 2.00 GiB of a 139.80 GiB GPU); ...' from torch's message."""
    tried = allocation_size(err)
    total = re.search(r"total capacity of ([0-9.]+ [KMGT]?i?B)", str(err))
    what = ", ".join(p for p in (tried and f"tried to allocate {tried}",
                                 total and f"of a {total.group(1)} device") if p)  # fmt: skip
    return (f"device out of memory{f' ({what})' if what else ''}: use a shorter context, a smaller batch or "
            "more GPUs, or free the device of other processes")


def _flat(text: str) -> str:
    """Collapse a multi-line message into one line (first line kept whole, the rest joined)."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return "; ".join(parts) if len(parts) <= 3 else "; ".join(parts[:3]) + " ..."


def _os_error(err: OSError) -> str:
    where = err.filename or ""
    if err.filename2:
        where = f"{where} -> {err.filename2}"
    reason = err.strerror or str(err) or type(err).__name__
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"cannot write {where or 'the output'}: {reason} (disk full); free space or choose another "
                "output directory, then rerun (with --resume where the command has it)")  # fmt: skip
    if err.errno == errno.EISDIR:
        return f"{where}: is a directory where a file is expected"
    if err.errno == errno.ENOTDIR:
        return f"{where}: a part of this path is a file where a directory is expected"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{where}: {reason} (check the path's permissions, or choose another path)"
    return f"{where}: {reason}" if where else _flat(reason)


# what each alternative of a union field accepts, by pydantic's error type (one failed alternative each)
_ACCEPTS = {"bool_parsing": "true", "bool_type": "true", "int_parsing": "an integer", "int_type": "an integer",
            "float_parsing": "a number", "float_type": "a number", "string_type": "a string",
            "none_required": "null"}  # fmt: skip


def _is_member_tag(part: object) -> bool:
    """A union member's tag in an error's location (`bool`, `int`, "literal['auto']", `list[int]`), not a
    field name."""
    return isinstance(part, str) and (part in ("bool", "int", "float", "str", "bytes", "none") or "[" in part)


def _union_alternatives(errors: list[dict]) -> list[str] | None:
    """For the first error's field when it is a union (pydantic reports one error per failed member, at
    loc + (member tag,)): what the members accept, e.g. ['true', 'false', "'auto'"]; None otherwise."""
    if not errors[0]["loc"] or not _is_member_tag(errors[0]["loc"][-1]):
        return None
    field = errors[0]["loc"][:-1]
    members = [e for e in errors if e["loc"][:-1] == field and e["loc"] and _is_member_tag(e["loc"][-1])]
    if len(members) < 2 or len({e["loc"][-1] for e in members}) != len(members):
        return None
    alternatives: list[str] = []
    for e in members:
        if e["type"] == "literal_error":
            # pydantic words a literal's values as one phrase, "'a', 'b' or 'c'": one alternative each
            expected = str((e.get("ctx") or {}).get("expected", e["loc"][-1]))
            alternatives += expected.replace(" or ", ", ").split(", ")
        elif e["type"] in _ACCEPTS:
            alternatives += ["true", "false"] if e["type"].startswith("bool") else [_ACCEPTS[e["type"]]]
        else:
            return None  # a constraint of a member (a bound, a pattern): its own message says more
    return alternatives


def format_validation_error(err: ValidationError) -> str:
    """One line: the first error's dotted location, message and input (+ how many more). A union field
    (e.g. `bool | Literal["auto"]`) gets one line naming every value it accepts."""
    errors = err.errors()
    first = errors[0]
    alternatives = _union_alternatives(errors)
    if alternatives is not None:
        field = first["loc"][:-1]
        loc = ".".join(str(p) for p in field) or "recipe"
        rest = sum(1 for e in errors if e["loc"][:-1] != field)
        accepted = ", ".join(alternatives[:-1]) + " or " + alternatives[-1]
        text = f"{loc}: must be {accepted} (got {repr(first.get('input'))[:60]})"
        return text + (f" (and {rest} more)" if rest else "")
    loc = ".".join(str(p) for p in first["loc"]) or "recipe"
    msg = first["msg"].removeprefix("Value error, ")
    more = len(errors) - 1
    shown = repr(first.get("input"))
    text = f"{loc}: {msg}" + (
        f" (got {shown[:60]})" if first["type"] != "missing" and "input" in first else ""
    )
    return text + (f" (and {more} more)" if more else "")


def one_line(err: BaseException) -> str:
    """The one line a user sees for `err` (no type names unless they are the only information)."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        return _flat(format_validation_error(err))
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at offset {err.start})"
    if isinstance(err, json.JSONDecodeError):
        return f"line {err.lineno} column {err.colno}: not valid JSON ({err.msg})"
    if isinstance(err, OSError):
        return _os_error(err)
    text = str(err)
    if is_out_of_memory(err) and not isinstance(err, RunFault):  # a RunFault's line has the trainer's advice
        return _out_of_memory(err)
    if any(m in text for m in _DISK_FULL):
        return f"disk full while writing ({_flat(text)}); free space or choose another output directory"
    if type(err).__name__ == "SafetensorError":
        return f"not a complete safetensors file ({_flat(text)})"
    try:
        import yaml

        if isinstance(err, yaml.YAMLError):
            return _yaml_message(err)
    except ImportError:  # pragma: no cover - yaml is a dependency
        pass
    return _flat(text) or type(err).__name__


def is_user_error(err: BaseException) -> bool:
    """Errors that a user's input or machine causes (one line), as opposed to bugs (a traceback)."""
    if isinstance(err, (ValueError, OSError, RunFault)) or is_out_of_memory(err):
        return True
    name = type(err).__name__
    if name in ("SafetensorError", "YAMLError") or any(m in str(err) for m in _DISK_FULL):
        return True
    try:
        import yaml

        return isinstance(err, yaml.YAMLError)
    except ImportError:  # pragma: no cover
        return False


def _yaml_message(err) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or _flat(str(err))
    context = getattr(err, "context", None)
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def read_text(path: str | os.PathLike, field: str) -> str:
    """The whole file as UTF-8; one-line ValueError naming `field`, the file and the line of a bad byte."""
    path = check_input_file(path, field)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"{field}: cannot read {path}: {err.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{field}: {path}:{line} is not UTF-8 text (byte {data[err.start:err.start + 1]!r}); "
                         "convert the file to UTF-8") from None  # fmt: skip


def read_lines(path: str | os.PathLike, field: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every line, decoded as UTF-8 one line at a time (streams large files)."""
    path = check_input_file(path, field)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator cannot use `with` across yields safely
    except OSError as err:
        raise ValueError(f"{field}: cannot read {path}: {err.strerror}") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{field}: {path}:{n} is not UTF-8 text (byte {raw[err.start:err.start + 1]!r} "
                                 f"at column {err.start + 1}); convert the file to UTF-8") from None  # fmt: skip


def read_jsonl(path: str | os.PathLike, field: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed JSON) of every non-blank line (streamed); one-line ValueError with
    `field`, file and line on a bad line. What a value must be (an object, a record) is the caller's check."""
    for n, line in read_lines(path, field):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field}: {os.fspath(path)}:{n} is not valid JSON ({err.msg})") from None


def load_json(path: str | os.PathLike, field: str) -> Any:
    """Parsed JSON of a file; one-line ValueError with `field`, file, line and column on any problem."""
    text = read_text(path, field)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{field}: {os.fspath(path)}:{err.lineno}:{err.colno} is not valid JSON ({err.msg})") from None


def load_yaml(path: str | os.PathLike, field: str) -> Any:
    """Parsed YAML of a file; one-line ValueError with `field`, file and line on any problem."""
    import yaml

    text = read_text(path, field)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{field}: {os.fspath(path)} is not valid YAML: {_yaml_message(err)}") from None


def load_config(path: str | os.PathLike, field: str) -> Any:
    """A config file: YAML when it is named .yaml / .yml, JSON otherwise (the readers above, their errors)."""
    loader = load_yaml if os.fspath(path).endswith((".yaml", ".yml")) else load_json
    return loader(path, field)
