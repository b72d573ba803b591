"""`specserve bench fleet`: the suffix pool's memory shared across requests
and target replicas (the fleet memory) against each request's own, in one run.

Starts the Serve app (`specserve serve`, `specserve.tools.serveproc`) once per
system, each with two target replicas of the same model, routed by Ray Serve's
default (power of two choices, so that a family's members land on both
replicas) and one suffix draft pool:

- shared: `suffix.share: true` (the default): one memory for every request
  of every target replica;
- unshared: `suffix.share: false`: each request drafts from its own prompt
  and output only.

The workload is the edit workload's family category
(`specserve.tools.bench.edit_workload.family`: one template, the name
changed), sent one request at a time, greedy, so a member's drafts can come
from the answers of the members before it. It prints, side by side, the
suffix pool's accepted / drafted tokens, coverage and mean acceptance length
(`/v1/spec/stats`, the run's difference), output tokens/s, and the requests
each target replica served. Never runs in the test suite (minutes);
docs/benchmarks.md has a run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specserve.tools.bench.edit_workload import _NAMES, family
from specserve.tools.bench.stats import fmt, markdown_table
from specserve.tools.serveproc import ServeProcess, get, post

SYSTEMS = ("shared", "unshared")
POOL = "suffix"
MAX_MEMBERS = len(_NAMES)  # distinct members (names) of the family


def add_arguments(p, positive_int) -> None:
    p.add_argument("--target", help="target model folder (default: the embedded default "
                   "model, as `make serve`)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--members", type=positive_int("members"), default=MAX_MEMBERS,
                   help=f"family members sent, one at a time (at most {MAX_MEMBERS}, "
                        "default all)")
    p.add_argument("--max-tokens", type=positive_int("max-tokens"), default=96)
    p.add_argument("--rounds", type=positive_int("rounds"), default=1,
                   help="times the family is sent (each round after the first finds "
                        "the whole family's answers in a shared memory)")
    p.add_argument("--json", dest="json_path", help="also write the results here")


def check(args) -> None:
    """ValueError for arguments the run cannot take."""
    if args.members > MAX_MEMBERS:
        raise ValueError(f"--members: the family has {MAX_MEMBERS} members (names); "
                         f"got {args.members}")


def config(target: str, system: str) -> dict:
    engine = {"dtype": "float32", "kv_cache_gib": 1, "enforce_eager": True}
    return {"target": {"model": target, "name": "bench",
                       "replicas": {"min_replicas": 2, "max_replicas": 2},
                       "resources": {"cpus_per_worker": 1}, "engine": engine},
            "drafts": [{"name": POOL, "kind": "suffix",
                        "replicas": {"min_replicas": 1, "max_replicas": 1},
                        "resources": {"cpus_per_worker": 0},
                        "suffix": {"share": system == "shared"}}],
            "routing": {"target": "serve"},
            "ray": {"num_cpus": 5}}


def pool_figures(before: dict, after: dict) -> dict:
    """The suffix pool's figures over the run (/v1/spec/stats after minus
    before) and the requests per target replica."""
    def pool(snap):
        return next((m for m in snap.get("draft_models", []) if m["model"] == POOL), {})

    def delta(key):
        return pool(after).get(key, 0) - pool(before).get(key, 0)

    drafted, accepted = delta("draft_tokens"), delta("accepted_tokens")
    steps, with_drafts = delta("target_steps"), delta("steps_with_drafts")
    served = {t["replica"]: t["requests"] for t in after.get("targets", [])}
    for t in before.get("targets", []):
        served[t["replica"]] = served.get(t["replica"], 0) - t["requests"]
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "coverage": with_drafts / steps if steps else None,
            "mean_accepted_length": 1 + accepted / with_drafts if with_drafts else None,
            "requests_per_replica": sorted((n for n in served.values() if n > 0),
                                           reverse=True)}


def run_system(target: str, system: str, prompts: list[str], max_tokens: int, rounds: int,
               work: Path) -> dict:
    server = ServeProcess(config(target, system), work / system)
    try:
        server.wait_ready("bench", timeout=900)
        _, before = get(f"{server.url}/v1/spec/stats", timeout=60)
        tokens, started = 0, time.monotonic()
        for _ in range(rounds):
            for prompt in prompts:
                status, body = post(f"{server.url}/v1/chat/completions", {
                    "model": "bench", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                    timeout=600)
                if status != 200:
                    raise RuntimeError(f"{system}: a request failed ({status}): {body}")
                tokens += body["usage"]["completion_tokens"]
        wall = time.monotonic() - started
        time.sleep(1)  # the last records reach the ledger
        _, after = get(f"{server.url}/v1/spec/stats", timeout=60)
    finally:
        server.stop()
    out = pool_figures(before, after)
    out.update(requests=rounds * len(prompts), output_tokens_per_s=tokens / wall, wall_s=wall)
    return out


def markdown(report: dict) -> str:
    def rate(r):
        return f"{fmt(r['acceptance_rate'], 3)} ({r['accepted_tokens']} / {r['draft_tokens']})"

    cells = [{"system": name, "acceptance": rate(r), "coverage": fmt(r["coverage"], 3),
              "length": fmt(r["mean_accepted_length"]), "tps": fmt(r["output_tokens_per_s"]),
              "replicas": ", ".join(str(n) for n in r["requests_per_replica"]),
              "wall": fmt(r["wall_s"], 1)} for name, r in report["systems"].items()]
    table = markdown_table(cells, [
        ("system", "system"), ("acceptance", "accepted / drafted"), ("coverage", "coverage"),
        ("length", "mean acc. len"), ("tps", "tok/s"),
        ("replicas", "requests per target replica"), ("wall", "wall (s)")])
    w, systems = report["workload"], report["systems"]
    ratio = ""
    if {"shared", "unshared"} <= set(systems) and systems["unshared"]["acceptance_rate"] \
            and systems["shared"]["acceptance_rate"] is not None:
        ratio = (f"\n\nshared / unshared acceptance: "
                 f"{systems['shared']['acceptance_rate'] / systems['unshared']['acceptance_rate']:.2f}x")
    return (f"{w['members']} family members x {w['rounds']} rounds, {w['max_tokens']} tokens "
            f"each, one at a time, two target replicas\n\n" + table + ratio)


def run(args, work: Path) -> dict:
    check(args)
    target = args.target
    if target is None:
        from specserve.models import ensure_default_model

        target = str(ensure_default_model())
    prompts = [r["turns"][0] for r in family(args.members)]
    report = {"workload": {"members": args.members, "rounds": args.rounds,
                           "max_tokens": args.max_tokens, "target": target},
              "systems": {}}
    for system in args.systems:
        print(f"specserve bench fleet: {system} ...", file=sys.stderr, flush=True)
        report["systems"][system] = run_system(target, system, prompts, args.max_tokens,
                                               args.rounds, work)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    return report
