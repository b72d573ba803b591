"""Serving with the default draft against target-only, on this machine (a measurement,
not a test): `PYTHONPATH=. .venv/bin/python scripts/measure_default_draft.py [N] [--dtype DTYPE]`.

Starts `specserve serve` twice with cluster/model-draft.yaml: as shipped
(the distilled default draft) and with `--draft none`. Sends the same N
held-out chat prompts (greedy, 96 tokens) one at a time, then all at once;
prints output tokens/s of each, whether the texts are equal, and the
router's acceptance figures, chosen K and the figures the choice used
(`k_choice`) for the draft pool. `differences` lists, per pair of runs, the
prompts whose texts differ (index: first differing character), also between
one-at-a-time and all-at-once within one server (batch-shape numerics).
--dtype sets both engines' dtype (default: the config's, auto = bf16 on CPU).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path



from specserve.tools.serveproc import ServeProcess, get, post  # noqa: E402

from specserve.tools.distill.run import eval_prompts  # noqa: E402

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


def config_with_dtype(dtype: str | None) -> dict:
    """cluster/model-draft.yaml with both engines' dtype set (None: as is)."""
    import yaml

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster/model-draft.yaml")
                         .read_text())
    if dtype is None:
        return cfg
    for engine in [cfg["target"]["engine"]] + [d["engine"] for d in cfg["drafts"]]:
        engine["dtype"] = dtype
    return cfg


def differences(a: list[str], b: list[str]) -> dict[int, int]:
    """{prompt index: first differing character} for texts that differ."""
    out = {}
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            out[i] = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return out


def main(n: int, dtype: str | None = None) -> None:
    prompts = eval_prompts(48)[-n:]  # held-out topics, never trained on
    runs = {}
    for name, extra in (("draft", []), ("target_only", ["--draft", "none"])):
        with tempfile.TemporaryDirectory() as tmp:
            server = ServeProcess(config_with_dtype(dtype), Path(tmp), extra_args=extra)
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
    summary["k_choice"] = runs["draft"]["stats"].get("k_choice")
    summary["dtype"] = dtype or "config (auto)"
    texts = {f"{name}/{label}": runs[name][label]["texts"]
             for name in ("draft", "target_only") for label in ("sequential", "concurrent")}
    summary["differences"] = {
        f"{x} vs {y}": differences(texts[x], texts[y])
        for x, y in (("target_only/sequential", "target_only/concurrent"),
                     ("draft/sequential", "target_only/sequential"),
                     ("draft/concurrent", "target_only/concurrent"),
                     ("draft/concurrent", "target_only/sequential"))}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=8)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None)
    args = ap.parse_args()
    main(args.n, args.dtype)
