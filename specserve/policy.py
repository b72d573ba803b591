"""Speculation policies: how many tokens to draft (K) and which draft pool to use.

Pure functions of measured figures; no Ray, no clock. The model (Leviathan et
al.): with per-token acceptance a and K drafted tokens, a verify step emits on
average E(a, K) = (1 - a^(K+1)) / (1 - a) tokens. It costs one target step plus
the verification of K more tokens, each costing `v` of a step. v is small while
the target is memory-bound (low batch) and tends to 1 as it saturates, when
every extra token costs real compute: v = v_idle + (1 - v_idle) * load. The
draft runs on other hardware, so its own cost does not slow the target (it only
limits coverage, which the measured acceptance already reflects).

    speedup(a, K, v) = E(a, K) / (1 + v K)        (K = 0: exactly 1)

choose_k picks the K in 0..k_max with the best speedup, so K falls as
acceptance drops or load rises, reaching 0 (no speculation) when verification
would cost more than it saves, and rises again when speculation pays.
"""

from __future__ import annotations

import dataclasses

V_IDLE = 0.05  # marginal cost of one verified token at low load, in target steps
MIN_SAMPLES = 64  # drafted tokens before a pool's acceptance is trusted ...
MIN_REQUESTS = 4  # ... unless this many requests went to it and drafted little
PROBE_EVERY = 16  # a pool held at K=0 for low acceptance is re-measured this often


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verify step with acceptance alpha and K drafted tokens."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verify_cost(load: float, v_idle: float = V_IDLE) -> float:
    load = min(max(load, 0.0), 1.0)
    return v_idle + (1.0 - v_idle) * load


def speedup(alpha: float, k: int, load: float, v_idle: float = V_IDLE) -> float:
    return expected_tokens(alpha, k) / (1.0 + verify_cost(load, v_idle) * k)


def choose_k(alpha: float, k_max: int, load: float, v_idle: float = V_IDLE) -> int:
    """The K in 0..k_max with the best expected speedup (ties: the smaller K)."""
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        s = speedup(alpha, k, load, v_idle)
        if s > best + 1e-9:
            best_k, best = k, s
    return best_k


@dataclasses.dataclass
class PoolView:
    """What the router knows about one draft pool."""

    name: str
    draft_tokens: int  # measured so far
    acceptance_rate: float
    coverage: float  # share of target steps that found this pool's drafts waiting
    requests: int  # routed so far
    inflight: int  # requests using it now
    replicas: int = 1


def is_fresh(p: PoolView) -> bool:
    """Too little measured to judge: a pool whose drafts never arrive in time
    stops being fresh after MIN_REQUESTS requests (its coverage is then 0)."""
    return p.draft_tokens < MIN_SAMPLES and p.requests < MIN_REQUESTS


@dataclasses.dataclass
class Choice:
    pool: str | None
    k: int
    reason: str


def choose(pools: list[PoolView], k_max: int, load: float, turn: int) -> Choice:
    """Draft pool and K for the next request.

    Pools without enough measurements are tried first (round-robin by turn),
    at full K. Otherwise the pool with the best expected speedup, discounted by
    its coverage and by how busy its replicas are, wins, with its own K. A pool
    whose best K is 0 because its acceptance is low gets a probe every
    PROBE_EVERY turns so that a recovery is noticed; with high load every pool
    gets K = 0 (the target serves alone) until load falls.
    """
    if not pools or k_max <= 0:
        return Choice(None, 0, "no draft pools")
    fresh = [p for p in pools if is_fresh(p)]
    if fresh:
        p = fresh[turn % len(fresh)]
        return Choice(p.name, k_max, f"measuring {p.name} ({p.draft_tokens} tokens so far)")

    def value(p: PoolView) -> tuple[float, int]:
        k = choose_k(p.acceptance_rate, k_max, load)
        gain = speedup(p.acceptance_rate, k, load) - 1.0
        busy = p.inflight / max(p.replicas, 1)
        return gain * max(p.coverage, 0.05) / (1.0 + 0.05 * busy), k

    scored = sorted(((value(p), p) for p in pools), key=lambda x: -x[0][0])
    (score, k), best = scored[0]
    if k > 0:
        return Choice(best.name, k, f"{best.name}: acceptance {best.acceptance_rate:.2f}, "
                      f"coverage {best.coverage:.2f}, load {load:.2f} -> K={k}")
    if choose_k(1.0, k_max, load) == 0:
        return Choice(None, 0, f"target saturated (load {load:.2f}): no speculation")
    if turn % PROBE_EVERY == 0:
        p = pools[(turn // PROBE_EVERY) % len(pools)]
        return Choice(p.name, k_max, f"probing {p.name} (low acceptance)")
    return Choice(None, 0, "no pool's acceptance pays for speculation")
