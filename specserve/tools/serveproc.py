"""`specserve serve` as a child process, and a small HTTP client for it.

Owns: starting the serve command with a config file on a free port
(`specserve.ports.free_port`), waiting until it answers,
applying a changed config file with SIGHUP (`apply`), stopping it with
SIGTERM (killing whatever it leaves behind, and saying so),
and the plain-urllib requests `specserve bench` and the tests send (JSON GET and
POST, a streaming chat completion read as server-sent events). No Ray or Serve
imports: everything goes through the command line and HTTP, as a user's would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specserve.ports import free_port


def _body(raw: bytes):
    """JSON when it is JSON (ours always is; Serve's proxy may answer in text)."""
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")


def get(url: str, headers: dict | None = None, timeout: float = 30):
    """(status, parsed JSON body or text) of a GET."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _body(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


def post(url: str, body, headers: dict | None = None, timeout: float = 120):
    """(status, parsed JSON body or text) of a POST; raw bytes allowed as body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _body(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


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
    """`python -m specserve.cli serve [CONFIG]` on a free port, its output in
    workdir/serve.log. `config`: a config mapping (its http.port is set to the
    free port) or None for the embedded default (`--port` passed); extra_args
    go to the command line, env on top of this process's environment."""

    def __init__(self, config: dict | None, workdir: Path, extra_args: list[str] = (),
                 env: dict | None = None):
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "specserve.cli", "serve"]
        self.config_path = None
        if config is not None:
            import yaml

            config = {**config, "http": {**config.get("http", {}), "port": self.port}}
            self.config_path = workdir / "serve-config.yaml"
            self.config_path.write_text(yaml.safe_dump(config))
            args.append(str(self.config_path))
        else:
            args += ["--port", str(self.port)]
        self.logfile = workdir / "serve.log"
        self._log = open(self.logfile, "w")
        self.proc = subprocess.Popen(
            args + list(extra_args), stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._seen: dict = {}
        self.left_running: list[int] = []  # pids stop() had to kill

    def apply(self, config: dict, timeout: float = 600) -> None:
        """Rewrite the config file (on the same port) and SIGHUP serve, as a
        user changing a running app would; until serve says it applied it."""
        import yaml

        if self.config_path is None:
            raise RuntimeError("serve was started without a config file")
        config = {**config, "http": {**config.get("http", {}), "port": self.port}}
        ends = ("applied the changed config", "the changed config is refused",
                "the changed config did not deploy")
        before = [self.tail(10**8).count(end) for end in ends]
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = [self.tail(10**8).count(end) for end in ends]
            if now[0] > before[0]:
                return
            if now[1:] != before[1:] or self.proc.poll() is not None:
                raise RuntimeError(f"serve did not apply the config:\n{self.tail()}")
            time.sleep(1)
        raise RuntimeError(f"serve did not apply the config in {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        if not self._log.closed:  # stop() closes it; the file stays readable
            self._log.flush()
        return self.logfile.read_text()[-n:]

    def remember_children(self) -> None:
        """Note the processes serve has started, so stop() can check they end."""
        import psutil

        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def wait_ready(self, model: str, timeout: float = 600,
                   headers: dict | None = None) -> None:
        """Until serve says it is serving (every pool up) and a 1-token
        completion of `model` succeeds (sent with `headers`, e.g. an API key)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specserve serve exited early:\n{self.tail()}")
            if "specserve: serving" in self.tail(10**7):
                try:
                    status, _ = post(f"{self.url}/v1/completions",
                                     {"model": model, "prompt": "hi", "max_tokens": 1},
                                     headers, timeout=30)
                    if status == 200:
                        self.remember_children()
                        return
                except OSError:  # URLError, connection refused or reset, timeouts
                    pass
            time.sleep(2)
        raise RuntimeError(f"specserve serve not ready after {timeout:.0f}s:\n{self.tail()}")

    def stop(self, timeout: float = 120, require_clean: bool = False) -> int:
        """SIGTERM and wait; returns serve's exit code. Processes it leaves
        behind are killed and listed in `left_running`; with require_clean, any
        such process is an error (RuntimeError)."""
        import psutil

        self.remember_children()
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
        self.left_running = [p.pid for p in alive]
        if require_clean and alive:
            raise RuntimeError(f"left running after shutdown: {self.left_running}")
        return code
