"""Reading a config: YAML files and the errors a person can act on.

Owns turning a file into plain data (`read_yaml`: missing file, directory,
undecodable text, invalid YAML and repeated keys are each one clear
`ConfigError`) and turning pydantic's validation errors into one
"field.path: problem" line each (`format_errors`: unknown keys get the valid
keys and the closest match). Knows nothing of the schema's fields: the root
model is passed in.
"""

from __future__ import annotations

import difflib
import io
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

# The CPU default that `specserve` runs when given no config file, and the one
# `specserve serve --draft PATH` starts from (the target beside a draft model).
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "cluster" / "default.yaml"
MODEL_DRAFT_CONFIG_PATH = DEFAULT_CONFIG_PATH.with_name("model-draft.yaml")


class ConfigError(ValueError):
    """A config that cannot be used. The message has one "field.path: problem"
    line per problem; `errors` holds those lines."""

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = errors or []


def read_yaml(path: str | Path) -> Any:
    """The parsed YAML of a config file (None for an empty file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML "
                          f"file such as {DEFAULT_CONFIG_PATH}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass a YAML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    stream = io.StringIO(text)
    stream.name = str(path)  # so YAML errors say `in "path", line N` instead of <unicode string>
    try:
        return yaml.load(stream, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None


def validation_error(e: ValidationError, root: type[BaseModel], source: str) -> ConfigError:
    """pydantic's errors for `source` as one ConfigError, one line per problem."""
    lines = [format_error(err, root) for err in e.errors()]
    return ConfigError(f"invalid config {source}:\n" + "\n".join(f"  {l}" for l in lines), lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping: PyYAML keeps the
    last one silently, which hides copy-paste mistakes."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The config model class found at a location such as ("drafts", 0, "replicas")."""
    model = root
    for part in loc:
        if isinstance(part, int):  # a list index: the list's item type was taken already
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def format_error(err: dict, root: type[BaseModel]) -> str:
    """One pydantic error as "field.path: problem"."""
    loc = tuple(err["loc"])
    kind = err["type"]
    msg = err["msg"]
    if kind == "extra_forbidden":
        model = _model_at(root, loc[:-1])
        key = str(loc[-1])
        if model is not None:
            valid = list(model.model_fields)
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            msg = f"unknown key; {hint}valid keys: {', '.join(valid)}"
        else:
            msg = "unknown key"
    elif kind == "value_error":
        # Our own validators' messages: drop pydantic's "Value error, " prefix.
        msg = msg.removeprefix("Value error, ")
        # AppConfig's checks carry their path at the start of the message.
        if not loc:
            return msg
    elif kind != "missing" and isinstance(err.get("input"), (str, int, float, bool, type(None))):
        msg = f"{msg} (got {err['input']!r})"
    return f"{_format_loc(loc) or '(top level)'}: {msg}"
