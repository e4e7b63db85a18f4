"""Reading a user operator's folder: ``kato.toml`` and the CUDA files it names.

Nothing is compiled or run here: the folder is parsed, validated
(:class:`~kernels.user.model.OperatorDefinition`) and its files read as text.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from kato.kernels.spec import InvalidInput
from kato.kernels.user.expr import ExpressionError
from kato.kernels.user.model import MAX_FILE_BYTES, OperatorDefinition
from pydantic import ValidationError

#: The spec file of a folder.
SPEC_FILE = "kato.toml"


def validation_message(exc: ValidationError, where: str) -> str:
    """A pydantic error as one readable line per problem (location: message), at most 10."""
    lines = []
    for error in exc.errors()[:10]:
        loc = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {message}" if loc else message)
    more = len(exc.errors()) - len(lines)
    return f"{where}: " + "; ".join(lines) + (f"; and {more} more" if more > 0 else "")


def definition(spec: Any, files: dict[str, str], where: str = "spec") -> OperatorDefinition:
    """An :class:`OperatorDefinition` from a parsed spec and its files.

    Raises:
        InvalidInput: what is wrong, naming the field (and the expression's part).
    """
    try:
        return OperatorDefinition(spec=spec, files=files)
    except ExpressionError as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    except ValidationError as exc:
        raise InvalidInput(validation_message(exc, where)) from None


def load_folder(path: str | Path) -> OperatorDefinition:
    """The operator of the folder ``path`` (its ``kato.toml`` and the files it names).

    Raises:
        InvalidInput: no such folder or spec file, a TOML error, a file missing or too large,
            or anything the spec's validation refuses (each message says what to fix).
    """
    folder = Path(path)
    spec_file = folder / SPEC_FILE
    if not folder.is_dir():
        raise InvalidInput(f"{folder}: not a directory")
    if not spec_file.is_file():
        raise InvalidInput(f"{folder}: no {SPEC_FILE} (the operator's spec) in this directory")
    try:
        spec = tomllib.loads(spec_file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{spec_file}: not valid TOML: {exc}") from None
    files: dict[str, str] = {}
    names = [spec.get("template")]
    reference = spec.get("reference")
    if isinstance(reference, dict):
        names.append(reference.get("template"))
    headers = spec.get("headers")
    if isinstance(headers, list):
        names.extend(headers)
    for name in names:
        if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
            continue  # the model says what is wrong with it
        file = folder / name
        if not file.is_file():
            raise InvalidInput(f"{spec_file}: names {name!r}, which is not a file in {folder}")
        if file.stat().st_size > MAX_FILE_BYTES:
            raise InvalidInput(f"{file}: over {MAX_FILE_BYTES} bytes")
        try:
            files[name] = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"{file}: not UTF-8 text") from None
    return definition(spec, files, str(spec_file))
