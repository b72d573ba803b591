"""Run `specserve serve` in a subprocess for tests: start, wait until it answers,
stop with SIGTERM, and check that no process of it is left behind."""

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
from pathlib import Path

import psutil
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(raw: bytes):
    """JSON when it is JSON (ours always is; Serve's proxy may answer in text)."""
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")


def post(url: str, body, headers: dict | None = None, timeout: float = 120):
    """(status, parsed JSON body) of a POST; raw bytes allowed as body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _body(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


def get(url: str, headers: dict | None = None, timeout: float = 30):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _body(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


class ServeProcess:
    def __init__(self, config: dict | None, workdir: Path, extra_args: list[str] = (),
                 env: dict | None = None):
        self.port = free_port()
        args = [sys.executable, "-m", "specserve.cli", "serve"]
        if config is not None:
            config = {**config, "http": {**config.get("http", {}), "port": self.port}}
            path = workdir / "config.yaml"
            path.write_text(yaml.safe_dump(config))
            args.append(str(path))
        else:
            args += ["--port", str(self.port)]
        self.log = open(workdir / "serve.log", "w")
        self.proc = subprocess.Popen(args + list(extra_args), stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        self.logfile = workdir / "serve.log"
        self.seen: dict[int, psutil.Process] = {}

    def remember_children(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def wait_ready(self, model: str, timeout: float = 600) -> None:
        """Until `serve` says it is serving (every pool up) and a 1-token
        completion succeeds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited early:\n{self.tail()}")
            if "specserve: serving" not in self.tail(10**7):
                time.sleep(2)
                continue
            try:
                status, _ = post(f"{self.url}/v1/completions",
                                 {"model": model, "prompt": "hi", "max_tokens": 1}, timeout=30)
                if status == 200:
                    self.remember_children()
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        raise RuntimeError(f"serve not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.logfile.read_text()[-n:]

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, wait; returns the exit code. Asserts nothing is left running."""
        self.remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=30)
        for p in alive:
            p.kill()
        self.log.close()
        assert not alive, f"left running after shutdown: {[p.pid for p in alive]}"
        return code
