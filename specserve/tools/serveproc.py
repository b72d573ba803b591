"""`specserve serve` as a child process, and a small HTTP client for it.

Owns: starting the serve command with a config file on a free port, waiting
until it answers, stopping it with SIGTERM (killing whatever it leaves behind),
and the plain-urllib requests `specserve bench` sends (a streaming chat
completion read as server-sent events, a JSON GET). No Ray or Serve imports:
everything goes through the command line and HTTP, as a user's would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 30):
    """(status, parsed JSON body or text)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode(errors="replace")


def stream_chat(url: str, body: dict, timeout: float = 600):
    """POST a streaming chat completion; (text, monotonic time of the first
    content, usage) from its server-sent events."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    text, first, usage = [], None, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if first is None:
                            first = time.monotonic()
                        text.append(piece)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} answered {e.code}: {e.read()[:500]!r}") from None
    return "".join(text), first, usage


class ServeProcess:
    """`python -m specserve.cli serve CONFIG` with config(port) written to workdir."""

    def __init__(self, config: Callable[[int], dict], workdir: Path):
        import yaml

        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "serve-config.yaml"
        path.write_text(yaml.safe_dump(config(self.port)))
        self.logfile = workdir / "serve.log"
        self._log = open(self.logfile, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", str(path)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ), start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._seen: dict = {}

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.logfile.read_text()[-n:]

    def _remember_children(self) -> None:
        import psutil

        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def wait_ready(self, model: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specserve serve exited early:\n{self.tail()}")
            if "specserve: serving" in self.tail(10**7):
                try:
                    stream_chat(f"{self.url}/v1/chat/completions",
                                {"model": model, "max_tokens": 1, "stream": True,
                                 "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
                    self._remember_children()
                    return
                except (RuntimeError, OSError):
                    pass
            time.sleep(2)
        raise RuntimeError(f"specserve serve not ready after {timeout:.0f}s:\n{self.tail()}")

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM and wait; processes it leaves behind are killed."""
        import psutil

        self._remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        _, alive = psutil.wait_procs(list(self._seen.values()), timeout=30)
        for p in alive:
            p.kill()
        self._log.close()
        return code
