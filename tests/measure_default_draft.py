"""Serving with the default draft against target-only, on this machine (a measurement,
not a test): `PYTHONPATH=. .venv/bin/python tests/measure_default_draft.py [N]`.

Starts `specserve serve` twice with the embedded default config: as shipped
(the distilled default draft) and with `--draft none`. Sends the same N
held-out chat prompts (greedy, 96 tokens) one at a time, then all at once;
prints output tokens/s of each, whether the texts are equal, and the
router's acceptance figures and chosen K for the draft pool.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import ServeProcess, get, post  # noqa: E402

from specserve.distill import eval_prompts  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def ask(url: str, prompt: str) -> tuple[str, int]:
    status, body = post(f"{url}/v1/chat/completions", {
        "model": MODEL, "max_tokens": 96, "temperature": 0,
        "messages": [{"role": "user", "content": prompt}]}, timeout=600)
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def measure(server: ServeProcess, prompts: list[str]) -> dict:
    server.wait_ready(MODEL, timeout=900)
    ask(server.url, "Hello")  # warm-up
    result = {}
    for label, workers in (("sequential", 1), ("concurrent", len(prompts))):
        started = time.monotonic()
        with ThreadPoolExecutor(workers) as pool:
            answers = list(pool.map(lambda p: ask(server.url, p), prompts))
        seconds = time.monotonic() - started
        result[label] = {"texts": [a for a, _ in answers],
                         "tokens_per_s": sum(n for _, n in answers) / seconds}
    result["stats"] = get(f"{server.url}/v1/spec/stats")[1]
    return result


def main(n: int) -> None:
    prompts = eval_prompts(48)[-n:]  # held-out topics, never trained on
    runs = {}
    for name, extra in (("draft", []), ("target_only", ["--draft", "none"])):
        with tempfile.TemporaryDirectory() as tmp:
            server = ServeProcess(None, Path(tmp), extra_args=extra)
            try:
                runs[name] = measure(server, prompts)
            finally:
                rc = server.stop()
                print(f"{name}: server exit {rc}", file=sys.stderr)
    pools = runs["draft"]["stats"].get("draft_models", [])
    summary = {
        label: {"draft_tokens_per_s": round(runs["draft"][label]["tokens_per_s"], 1),
                "target_only_tokens_per_s": round(runs["target_only"][label]["tokens_per_s"], 1),
                "same_text": runs["draft"][label]["texts"] == runs["target_only"][label]["texts"]}
        for label in ("sequential", "concurrent")
    }
    summary["draft_pools"] = [
        {k: pool.get(k) for k in ("model", "acceptance_rate", "mean_accepted_length", "coverage",
                                  "k", "draft_tokens", "target_steps")}
        for pool in (pools.values() if isinstance(pools, dict) else pools)]
    summary["last_choice"] = runs["draft"]["stats"].get("last_choice")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
