"""Shared fixtures: tiny seeded models, their target-only greedy reference, and a
helper that runs the real `specserve generate` CLI in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

# Small KV caches: several engines share this 24 GiB machine during tests.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

PROMPTS = ["Hello world", "The quick brown fox", "abc", "Speculative decoding on CPU"]
MAX_TOKENS = 48


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """target, a slightly perturbed copy, and an unrelated model (same tokenizer)."""
    from specserve.testing.tiny import build_model

    root = tmp_path_factory.mktemp("models")
    target = build_model(root / "target", seed=0)
    return {
        "target": target,
        "perturbed": build_model(root / "perturbed", seed=1, perturb_from=target, noise=0.15),
        "unrelated": build_model(root / "unrelated", seed=7),
    }


@pytest.fixture(scope="session")
def reference(tiny_models) -> list[list[int]]:
    """Hugging Face transformers' target-only greedy output for PROMPTS."""
    from specserve.testing.tiny import greedy_reference

    return greedy_reference(tiny_models["target"], PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """A tiny seeded draft for the online-adaptation tests (tests/adapt_models.py)."""
    from adapt_models import build_tiny_draft

    return build_tiny_draft(tmp_path_factory.mktemp("adapt") / "draft")


# On real hardware the target is many times slower per step than its draft; with
# tiny models on two shared cores both take the same few milliseconds, and a draft
# no faster than its target cannot run ahead of it. Tests that need drafts to
# arrive in time emulate a slower target step (specserve/testing/slow_target.py):
# these environment variables, given to the process that starts the target.
from specserve.testing import slow_target  # noqa: E402

SLOW_TARGET_ENV = slow_target.env(25)


class Loop:
    """An asyncio loop on a thread, so sync tests can drive async engines."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def run_cli(*args: str, timeout: float = 600, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli", *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def run_generate(target, draft, prompts=PROMPTS, *extra: str, env: dict | None = None) -> dict:
    """`specserve generate --json`; asserts stdout holds exactly one JSON object."""
    args = ["generate", "--target", str(target), "--draft", str(draft),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", "--dtype", "float32"]
    for p in prompts:
        args += ["--prompt", p]
    proc = run_cli(*args, *extra, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be one JSON object, got: {proc.stdout[:2000]}"
    result = json.loads(lines[0])
    result["_stderr"] = proc.stderr
    return result
