"""The routing bench's workload and figures (pure, no I/O).

Owns: a multi-turn chat workload made here from a seed (`make_conversations`:
each conversation a system prompt, shared by a few conversations as
deployments share them, and user turns of random words), reading the
per-replica counters the bench needs from specserve's /metrics text
(`replica_counters`: vLLM's prefix-cache queries and hits, finished
requests), and the comparison's figures (`figures`: prefix-cache hit rate,
TTFT p50, max/mean requests per replica). The run itself is
`specserve.tools.bench.routing`.
"""

from __future__ import annotations

import dataclasses
import random

from specserve.acceptance.record import percentile

WORDS = ("river stone lantern copper meadow violet harbor signal orbit pepper marble "
         "thunder willow cabin falcon garden ember quartz canyon ribbon saddle timber "
         "glacier walnut beacon velvet harvest prism tundra anchor").split()


@dataclasses.dataclass(frozen=True)
class Conversation:
    system: str
    users: tuple[str, ...]  # one user message per turn


def _words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def make_conversations(n: int, turns: int, seed: int = 0, system_chars: int = 300,
                       user_chars: int = 80, systems: int = 2) -> list[Conversation]:
    """n conversations of `turns` user turns; conversation i has system prompt
    i % systems. The same arguments make the same workload."""
    rng = random.Random(seed)
    prompts = [f"system {s}: " + _words(rng, system_chars) for s in range(systems)]
    return [Conversation(prompts[i % systems],
                         tuple(f"turn {t}: " + _words(rng, user_chars) for t in range(turns)))
            for i in range(n)]


COUNTERS = {"vllm:prefix_cache_queries": "queries", "vllm:prefix_cache_hits": "hits",
            "vllm:e2e_request_latency_seconds_count": "requests"}


def replica_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """{target replica: {"queries", "hits", "requests"}} from /metrics text
    (vLLM's names, labelled by target_replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            key = COUNTERS.get(s.name.removesuffix("_total"))
            replica = s.labels.get("target_replica")
            if key is not None and replica is not None:
                out.setdefault(replica, {"queries": 0.0, "hits": 0.0, "requests": 0.0})
                out[replica][key] += s.value
    return out


def figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
            ttfts: list[float], replicas: int) -> dict:
    """The comparison's figures over one run: counters after minus before,
    per replica; `replicas`: how many served (one that served nothing counts
    as 0 requests)."""
    delta = {r: {k: v - before.get(r, {}).get(k, 0.0) for k, v in c.items()}
             for r, c in after.items()}
    queries = sum(d["queries"] for d in delta.values())
    hits = sum(d["hits"] for d in delta.values())
    per = sorted((d["requests"] for d in delta.values() if d["requests"] > 0), reverse=True)
    per += [0.0] * max(replicas - len(per), 0)
    mean = sum(per) / len(per) if per else 0.0
    return {"prefix_cache_hit_rate": hits / queries if queries else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "requests_per_replica": per,
            "max_over_mean_requests": max(per) / mean if mean else None}
