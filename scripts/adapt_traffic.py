"""Serve a prompt file's traffic to a running specserve app for a while, and
record its draft pools' adaptation figures over time.

    PYTHONPATH=. .venv/bin/python scripts/adapt_traffic.py OUT --prompts train.jsonl \
        [--url http://127.0.0.1:8000] [--minutes 30] [--concurrency 4] [--max-tokens 64]

Sends the prompts (Spec-Bench JSONL, optional "system" message: what `specserve
adapt domain` writes) in file order, each once, as greedy chat completions from
`--concurrency` clients until `--minutes` have passed; every 30 s it reads
/v1/spec/stats and appends each adapting pool's `adapt` figures to
OUT/adapt-timeline.jsonl (and prints them). OUT/adapt-traffic.json sums up the
requests, tokens and failures. The run for docs/distill.md.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def adapt_rows(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/v1/spec/stats", timeout=60) as r:
        stats = json.loads(r.read())
    return [{"pool": row.get("pool"), **row["adapt"]} for row in stats.get("pools", [])
            if isinstance(row.get("adapt"), dict)]


def main() -> None:
    from specserve.tools.bench.workload import parse_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = parse_prompts(args.prompts.read_text().splitlines(), str(args.prompts))
    model = json.loads(urllib.request.urlopen(f"{args.url}/v1/models").read())["data"][0]["id"]
    deadline = time.monotonic() + args.minutes * 60
    start = time.monotonic()
    lock = threading.Lock()
    tally = {"requests": 0, "completion_tokens": 0, "failures": 0, "errors": []}
    queue = iter(prompts)

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                p = next(queue, None)
            if p is None:
                return
            try:
                r = post(f"{args.url}/v1/chat/completions",
                         {"model": model, "messages": p.messages(), "temperature": 0,
                          "max_tokens": args.max_tokens})
                n = r["usage"]["completion_tokens"]
                with lock:
                    tally["requests"] += 1
                    tally["completion_tokens"] += n
            except Exception as e:  # counted and shown: the run must have none
                with lock:
                    tally["failures"] += 1
                    tally["errors"] = (tally["errors"] + [repr(e)])[-5:]

    timeline = (args.out / "adapt-timeline.jsonl").open("a")
    with ThreadPoolExecutor(args.concurrency) as pool:
        clients = [pool.submit(client) for _ in range(args.concurrency)]
        while not all(c.done() for c in clients):
            time.sleep(30 - (time.monotonic() - start) % 30)
            t = round((time.monotonic() - start) / 60, 2)
            try:
                rows = adapt_rows(args.url)
            except Exception as e:
                rows = [{"error": repr(e)}]
            with lock:
                done = dict(tally)
            for row in rows:
                line = {"minute": t, "requests": done["requests"], "failures": done["failures"],
                        **row}
                timeline.write(json.dumps(line) + "\n")
                timeline.flush()
                print(json.dumps(line), flush=True)
    tally["minutes"] = round((time.monotonic() - start) / 60, 2)
    tally["final"] = adapt_rows(args.url)
    (args.out / "adapt-traffic.json").write_text(json.dumps(tally, indent=1) + "\n")
    print(json.dumps(tally, indent=1))


if __name__ == "__main__":
    main()
