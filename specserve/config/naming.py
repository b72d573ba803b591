"""Draft pool names: the rule they follow and names made from model folders.

Draft names become part of Serve deployment names (and Kubernetes object
names, which are DNS labels of at most 63 characters), so they are lowercase
words joined by '-', short enough to leave room for the prefix the app adds.
Pure string functions; the schema validates with `DRAFT_NAME_RE`, the CLI's
`--draft PATH` overrides name their pools with `pool_names`.
"""

from __future__ import annotations

import re
from pathlib import Path

DRAFT_NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
DRAFT_NAME_MAX_LEN = 40


def pool_names(paths: list[str]) -> list[str]:
    """One valid, unique pool name per model folder, in order."""
    names: list[str] = []
    for path in paths:
        names.append(unique_name(name_from_path(path), names))
    return names


def name_from_path(path: str) -> str:
    """A draft pool name from a model folder: 'Llama-3.2-1B_Instruct/' -> 'llama-3-2-1b-instruct'."""
    folder = Path(path).name or path
    name = re.sub(r"[^a-z0-9]+", "-", folder.lower()).strip("-")
    name = name[:DRAFT_NAME_MAX_LEN].strip("-")
    return name or "draft"


def unique_name(base: str, taken: list[str]) -> str:
    """base, or base-2, base-3, ... (shortened to fit) if base is taken."""
    if base not in taken:
        return base
    n = 2
    while True:
        suffix = f"-{n}"
        candidate = base[:DRAFT_NAME_MAX_LEN - len(suffix)].strip("-") + suffix
        if candidate not in taken:
            return candidate
        n += 1
