"""The `vllm_serve` bench system: vLLM's own OpenAI server, target only.

What a user runs instead of specserve: `python -m vllm.entrypoints.openai.api_server`
on the target with the engine settings specserve's target replica uses (dtype,
context, seed, batch size, KV cache, prefix caching, eager mode, the target's
CPU core), driven by the same streaming chat client as `specserve_http`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from specserve.tools.bench.backends import Counters, HttpBackend


class VllmServeBackend(HttpBackend):
    system = "vllm_serve"

    def command(self, port: int) -> list[str]:
        s = self.settings
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.target, "--served-model-name", self.name,
               "--dtype", s.dtype, "--seed", str(s.seed), "--max-num-seqs", str(s.max_num_seqs),
               "--host", "127.0.0.1", "--port", str(port)]
        if s.max_model_len:
            cmd += ["--max-model-len", str(s.max_model_len)]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
        cmd.append("--enable-prefix-caching" if s.enable_prefix_caching
                   else "--no-enable-prefix-caching")
        return cmd

    def env(self) -> dict:
        from specserve.engine import cpu_binding

        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.settings.kv_cache_gib or 1))
        target_cpus, _ = cpu_binding(1, model_draft=True)
        if target_cpus:  # the core specserve's target replica gets
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", target_cpus)
        return env

    async def start(self):
        from specserve.ports import free_port
        from specserve.tools.serveproc import stream_chat

        port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(Path(self.workdir) / "vllm-serve.log", "w")
        self._proc = subprocess.Popen(self.command(port), stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self.env(), start_new_session=True)
        self.server = type("Server", (), {"url": f"http://127.0.0.1:{port}"})()

        def ready():
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"vLLM's server exited early; see {self._log.name}")
                try:
                    stream_chat(f"{self.server.url}/v1/chat/completions",
                                {"model": self.name, "max_tokens": 1, "stream": True,
                                 "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
                    return
                except (RuntimeError, OSError):
                    time.sleep(2)
            raise RuntimeError("vLLM's server not ready after 600 s")
        await asyncio.to_thread(ready)

    async def close(self):
        if self.server is None:
            return
        self._proc.terminate()
        try:
            await asyncio.to_thread(self._proc.wait, 60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()
        self.server = None

    def counters(self) -> Counters:
        return Counters(0, 0, 0, [], None)  # target only: nothing drafted
