"""`specserve bench routing`: target routing by prefix against Serve's default, in one run.

Starts the Serve app (`specserve serve`, `specserve.tools.serveproc`) once per
system, with the same target model and the same seeded multi-turn chat
workload (`specserve.tools.bench.conversations`), one client per
conversation, each sending its turns in order with the replies it got:

- prefix: two target replicas, `routing.target: prefix` (deployments.routing);
- serve: two target replicas, Ray Serve's default routing (power of two);
- single: one target replica (the hit rate a conversation gets when every
  turn finds its replica's cache).

and prints, side by side, vLLM's prefix-cache hit rate (its own counters,
from /metrics), the TTFT p50 the clients saw, and max/mean requests per
target replica. Target-only (no draft pool): what is compared is the target's
choice. Never runs in the test suite (minutes); docs/benchmarks.md has a run.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specserve.tools.bench.conversations import (
    Conversation, figures, make_conversations, replica_counters,
)
from specserve.tools.serveproc import ServeProcess, get, stream_chat

SYSTEMS = ("prefix", "serve", "single")


def add_arguments(p, positive_int) -> None:
    p.add_argument("--target", help="target model folder (default: a tiny seeded Llama "
                   "built in the work folder, as the tests use)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--conversations", type=positive_int("conversations"), default=8)
    p.add_argument("--turns", type=positive_int("turns"), default=4)
    p.add_argument("--max-tokens", type=positive_int("max-tokens"), default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="also write the results here")


def config(target: str, system: str) -> dict:
    engine = {"dtype": "float32", "kv_cache_gib": 1}
    replicas = 1 if system == "single" else 2
    return {"target": {"model": target, "name": "bench",
                       "replicas": {"min_replicas": replicas, "max_replicas": replicas},
                       "resources": {"cpus_per_worker": 1}, "engine": engine},
            "routing": {"target": "serve" if system == "serve" else "prefix"},
            "ray": {"num_cpus": 2 * replicas + 1}}


def _converse(url: str, conv: Conversation, max_tokens: int) -> list[float]:
    """One client: the conversation's turns in order; the TTFT of each."""
    messages = [{"role": "system", "content": conv.system}]
    ttfts = []
    for user in conv.users:
        messages.append({"role": "user", "content": user})
        start = time.monotonic()
        text, first, _ = stream_chat(f"{url}/v1/chat/completions", {
            "model": "bench", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True})
        ttfts.append((first or time.monotonic()) - start)
        messages.append({"role": "assistant", "content": text})
    return ttfts


def _counters(url: str, replicas: int) -> dict:
    # Each target replica reports its engine's counters after every call it
    # serves; a few cheap calls (Serve spreads them) freshen every replica's.
    for _ in range(4 * replicas):
        get(f"{url}/v1/models")
    _, text = get(f"{url}/metrics")
    return replica_counters(text)


def run_system(target: str, system: str, convs: list[Conversation], max_tokens: int,
               work: Path) -> dict:
    replicas = 1 if system == "single" else 2
    server = ServeProcess(config(target, system), work / system)
    try:
        server.wait_ready("bench", timeout=600)
        before = _counters(server.url, replicas)
        started = time.monotonic()
        with ThreadPoolExecutor(len(convs)) as pool:
            ttfts = [t for ts in pool.map(lambda c: _converse(server.url, c, max_tokens), convs)
                     for t in ts]
        wall = time.monotonic() - started
        after = _counters(server.url, replicas)
        _, stats = get(f"{server.url}/v1/spec/stats")
    finally:
        server.stop()
    out = figures(before, after, ttfts, replicas)
    out.update(requests=len(ttfts), wall_s=wall,
               routing=(stats.get("routing") or {}).get("target") if isinstance(stats, dict)
               else None)
    return out


def markdown(report: dict) -> str:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    rows = ["| system | target replicas | prefix-cache hit rate | TTFT p50 (ms) | "
            "requests per replica | max/mean | wall (s) |", "|---|---|---|---|---|---|---|"]
    for name, r in report["systems"].items():
        rows.append(f"| {name} | {1 if name == 'single' else 2} | "
                    f"{f(r['prefix_cache_hit_rate'], '.3f')} | "
                    f"{f(r['ttft_p50_s'] and r['ttft_p50_s'] * 1e3, '.1f')} | "
                    f"{', '.join(str(int(n)) for n in r['requests_per_replica'])} | "
                    f"{f(r['max_over_mean_requests'], '.2f')} | {r['wall_s']:.1f} |")
    w = report["workload"]
    return (f"{w['conversations']} conversations x {w['turns']} turns, {w['max_tokens']} "
            f"tokens per reply, seed {w['seed']}\n\n" + "\n".join(rows))


def run(args, work: Path) -> dict:
    target = args.target
    if target is None:
        from specserve.testing.tiny import build_model

        target = str(build_model(work / "tiny-target", seed=0))
    convs = make_conversations(args.conversations, args.turns, args.seed)
    report = {"workload": {"conversations": args.conversations, "turns": args.turns,
                           "max_tokens": args.max_tokens, "seed": args.seed},
              "systems": {}}
    for system in args.systems:
        print(f"specserve bench routing: {system} ...", file=sys.stderr, flush=True)
        report["systems"][system] = run_system(target, system, convs, args.max_tokens, work)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    return report
