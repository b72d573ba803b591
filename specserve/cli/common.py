"""What every `specserve` command checks at the edge, and how it keeps stdout.

Owns `UsageError` (bad input: one line on stderr, exit code 2, raised before
any engine or cluster starts), the model folder checks, and
`results_on_stdout` (vLLM and its processes log to stdout; a command that
prints a result keeps stdout for it alone).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def model_dir(path: str, role: str) -> str:
    d = Path(path)
    if not d.is_dir():
        raise UsageError(f"{role} model folder {path} does not exist")
    if not (d / "config.json").is_file():
        raise UsageError(f"{role} model folder {path} has no config.json; "
                         "pass a Hugging Face model folder")
    return str(d.resolve())


def draft_dir(path: str) -> str:
    """A draft folder; 'default' is the shipped draft, assembled in the cache."""
    from specserve.models import DEFAULT_DRAFT_KEYWORD, resolve_draft

    if path == DEFAULT_DRAFT_KEYWORD:
        return resolve_draft(path)
    return model_dir(path, "draft")



def default_draft() -> str:
    """The shipped distilled draft of the default model, assembled in the cache."""
    from specserve.models import ensure_default_draft

    return str(ensure_default_draft())


@contextlib.contextmanager
def results_on_stdout():
    """Send everything written to file descriptor 1 (vLLM's logs, its child
    processes) to stderr while the body runs; stdout is the result's alone."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
