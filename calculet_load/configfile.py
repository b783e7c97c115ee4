"""Loading a YAML config into a pydantic model, with one-line errors naming the field.

Every config kind (manifest, mix, matrix, golden set, fault scenario, rules) is read the
same way: a file error or invalid YAML names the file (and line), a validation error
names the file and the dotted path of the first bad field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def read_yaml(path: str | Path, error: type[Exception]) -> Any:
    """The parsed YAML of `path`; `error(one line)` when unreadable or invalid."""
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise error(f"{p}:{where} invalid YAML") from None


def validate(model: type[M], data: Any, source: str, error: type[Exception]) -> M:
    """`model` validated from `data`; `error("source: field.path: message")` otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{source}: {first_error(exc)}") from None


def first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = "REQUIRED field missing" if err["type"] == "missing" else err["msg"]
    return f"{path}: {msg}"
