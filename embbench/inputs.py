"""Files the harness reads from a user (scenarios, result records, cache curves, fbgemm's TBE
reports, dlrm_datasets batches): one structural check for all of them.

:func:`user_file` takes a regular file of bounded size only: a FIFO would block for ever, a
device never end, so they are refused by name before anything opens them. :func:`read_text`
adds UTF-8 (the line of the first bad byte named), :func:`read_json` JSON (its line), and
:func:`validated` a schema: a pydantic model or type whose fields carry the bounds of
:mod:`embbench.bounds`, its first error named by its key path. Every error is one line that
names the file (``PATH: ...``), of the class the caller gives (a ValueError).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config

__all__ = ["MAX_INPUT_BYTES", "not_regular", "open_schema", "read_json", "read_text", "schema_error", "user_file", "validated"]

#: A schema (TypedDict) that keeps keys it does not name: a newer embbench may add some.
open_schema = with_config(ConfigDict(extra="allow"))

#: The largest JSON file read whole (a record with its profile is some hundred KiB).
MAX_INPUT_BYTES = 64 << 20


def not_regular(path: Path, mode: int | None = None) -> str | None:
    """What ``path`` is when it is not a regular file (``is a FIFO, not a regular file``), else
    None; ``mode`` from an ``fstat``, else the path's own (``lstat``: a link is named)."""
    if mode is None:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return None
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
             stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
    return "is " + next((name for test, name in kinds.items() if test(mode)), "something else") + ", not a regular file"


def user_file(path: Path, what: str, max_bytes: int | None = MAX_INPUT_BYTES, error: type = ValueError) -> int:
    """Check that ``path`` (links followed) is a regular file of at most ``max_bytes``; its size.

    Raises:
        error: ``PATH: no such WHAT file``, ``is a directory, not a WHAT file``, ``is a FIFO,
            not a regular file``, too large, or the OS error (a loop of links, ...).
    """
    try:
        mode, size = (info := os.stat(path)).st_mode, info.st_size
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except OSError as e:
        raise error(f"{path}: cannot open the {what}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise error(f"{path}: is a directory, not a {what} file")
    kind = not_regular(path, mode)
    if kind:
        raise error(f"{path}: {kind} (a {what} is read from a file; this one would block or never end)")
    if max_bytes is not None and size > max_bytes:
        raise error(f"{path}: {size:,} bytes; a {what} is at most {max_bytes:,}")
    return size


def read_text(path: Path, what: str, max_bytes: int = MAX_INPUT_BYTES, error: type = ValueError) -> str:
    """The UTF-8 text of a :func:`user_file`; ``error`` naming the file (and the line of a byte
    that is not UTF-8) otherwise."""
    user_file(path, what, max_bytes, error)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise error(f"{path}: line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None


def read_json(path: Path, what: str, error: type = ValueError) -> dict:
    """The JSON object of a :func:`read_text` file; ``error`` naming the file and the line
    where it is not JSON, or not an object."""
    text = read_text(path, what, error=error)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON (line {e.lineno}): {e.msg}; not a {what}") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply; not a {what}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a JSON {type(data).__name__}, not a {what} (an object)")
    return data


def schema_error(e: ValidationError) -> str:
    """The first thing wrong, as ``key.path: what`` (how many more there are, if any)."""
    errors = e.errors()
    first = errors[0]
    if first["type"] in ("record_field", "input_field"):  # raised by a model's own validator: the key is in the message
        text = first["msg"]
    else:
        key = ".".join(str(p) for p in first["loc"]) or "the file"
        text = f"{key}: {first['msg']}"
    return text + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")


def validated(schema: Any, data: Any, path: Path, error: type = ValueError, hint: str = "") -> Any:
    """``data`` checked against ``schema`` (a pydantic model, or a type for a TypeAdapter):
    the model, or ``error`` as ``PATH: key.path: what`` (and ``hint``)."""
    try:
        if isinstance(schema, type) and hasattr(schema, "model_validate"):
            return schema.model_validate(data)
        return TypeAdapter(schema).validate_python(data)
    except ValidationError as e:
        raise error(f"{path}: {schema_error(e)}{hint}") from None
