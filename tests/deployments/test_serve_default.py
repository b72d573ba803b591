"""`specserve serve` with no config (the embedded default: SmolLM2-135M-Instruct on
CPU with a suffix draft pool), exercised with the README's own curl and openai
examples, the edit among them: its drafts are accepted."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve_client import engine_core, replica_processes
from specserve.tools.serveproc import ServeProcess, get

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(lang: str, needle: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if needle in b]
    assert found, f"README has no {lang} block with {needle!r}"
    return found[0]


def target_engine_processes(server, timeout: float = 120) -> list:
    """The target replica's process and its processes, once its vLLM engine
    core is among them (serve_client.engine_core: found by place, as CI has
    listed them as plain `python` children)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        replicas = replica_processes(server, "target")
        core = engine_core(replicas[0]) if len(replicas) == 1 else None
        try:
            if core is not None:
                return [replicas[0], *replicas[0].children(recursive=True)]
        except psutil.NoSuchProcess:  # the replica ended meanwhile: look again
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no engine core under one target replica: {replicas}")
        time.sleep(1)


def test_default_app_answers_the_readme_examples(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    server = ServeProcess(None, tmp_path)
    try:
        server.wait_ready("SmolLM2-135M-Instruct", timeout=900)
        # At this process's own priority: Ray would start them 15 lower, under
        # every other process here (specserve.placement.RAY_NODE_ENV).
        engine = target_engine_processes(server)
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert [(p.name(), p.nice()) for p in engine] == [(p.name(), ours) for p in engine]
        curl = readme_block("sh", "curl http").replace("8000", str(server.port))
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["choices"][0]["message"]["content"].strip()
        code = readme_block("python", "OpenAI(").replace("8000", str(server.port))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()
        # The edit: an answer that repeats its input, drafted by the suffix pool,
        # whatever the requests before it drafted (CI once saw the chats above
        # hold the pool at K = 0, so the edit ran target-only).
        status, before = get(f"http://127.0.0.1:{server.port}/v1/spec/stats")
        assert status == 200, before
        edit = readme_block("sh", "spec/stats").replace("8000", str(server.port))
        out = subprocess.run(["bash", "-c", edit], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        reply, end = json.JSONDecoder().raw_decode(out.stdout)
        assert "Lyon" in reply["choices"][0]["message"]["content"]
        stats = json.loads(out.stdout[end:])
        assert [p["model"] for p in stats["draft_models"]] == ["suffix"]
        accepted = [s["draft_models"][0]["accepted_tokens"] if s["draft_models"] else 0
                    for s in (before, stats)]
        assert accepted[1] > accepted[0], (stats["draft_models"], stats["last_choice"])
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()
