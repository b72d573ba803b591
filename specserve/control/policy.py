"""Speculation policies: how many tokens to draft (K) and which draft pool to use.

Pure functions of measured figures; no Ray, no clock. This module owns the one
model of what speculation buys; `specserve.control.controller.KController`
decides with it for the Serve router and for LocalSpec alike.

A verify step over r decode rows, each with K drafted tokens, costs

    step_seconds = a + b · tokens,   tokens = r · (1 + cov · K)

(a: fixed cost per step, b: cost per processed token; `StepCost`). A row whose
drafts were waiting (share `cov`, the coverage, of its steps) emits on average
E(α, K) = (1 − α^(K+1)) / (1 − α) tokens (Leviathan et al.; α the measured
per-token acceptance), the others one, so the target's output rate is

    rate(K) = r · (1 + cov · (E(α, K) − 1)) / (a + b · r · (1 + cov · K))

and speedup(K) = rate(K) / rate(0). The draft runs on other hardware, so its
own cost does not slow the target; it only limits coverage.

a and b are measured on the target (`specserve.control.stepcost.StepCostFit`, fed with
vLLM's step timing). Before they are, the model stands in: one row, and a
verified token costs v = V_IDLE + (1 − V_IDLE) · load of a step (small while
the target is memory-bound, 1 when it is saturated): a = 1 − v, b = v, which
gives speedup = E(α, K) / (1 + v K) at full coverage. A measured b is never
counted below V_IDLE of a one-row step (a + b): speculation has per-token work
the target's step timing does not see (proposals through the sink, the draft
pool's time, rejected tokens), so a draft that is almost never accepted does
not get K > 0 just because the target verifies for free.

choose_k picks the K in 0..k_max with the best rate, so K falls as acceptance,
coverage or the margin of verification cost drop, reaching 0 (no speculation)
when verification would cost more than it saves, and rises again when
speculation pays.
"""

from __future__ import annotations

import dataclasses

V_IDLE = 0.05  # modelled marginal cost of one verified token at low load, in target steps


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When figures are trusted, how often to probe, how much gain is worth it
    (the config's `speculation.k_control`, specserve.config, describes each)."""

    min_drafted_tokens: int = 64  # drafted tokens before a pool's acceptance is trusted ...
    min_requests: int = 4  # ... unless this many requests went to it and drafted little
    probe_every: int = 16  # a pool held at K=0 is re-measured this often
    margin: float = 0.03  # with measured step costs, speculate only when predicted this much faster


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verify step with acceptance alpha and K drafted tokens."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Target decode step seconds = fixed + per_token · tokens."""

    fixed: float  # a
    per_token: float  # b
    measured: bool = True  # False: modelled from load (modelled_cost)


def verify_cost(load: float, v_idle: float = V_IDLE) -> float:
    """Modelled cost of one more verified token, in steps of one row."""
    load = min(max(load, 0.0), 1.0)
    return v_idle + (1.0 - v_idle) * load


def modelled_cost(load: float, v_idle: float = V_IDLE) -> StepCost:
    """The stand-in before the target's step costs are measured (use with rows = 1)."""
    v = verify_cost(load, v_idle)
    return StepCost(1.0 - v, v, measured=False)


def predicted_rate(alpha: float, coverage: float, k: int, rows: float, a: float,
                   b: float) -> float:
    """Output tokens per second of the target with r rows speculating K."""
    tokens = rows * (1.0 + coverage * (expected_tokens(alpha, k) - 1.0))
    return tokens / max(a + b * rows * (1.0 + coverage * k), 1e-12)


def speedup(alpha: float, k: int, load: float = 0.0, cost: StepCost | None = None,
            rows: float = 1.0, coverage: float = 1.0) -> float:
    """rate(K) / rate(0), with the measured cost, or the modelled one for `load`."""
    if cost is None:
        cost, rows = modelled_cost(load), 1.0
    # b >= V_IDLE · (a + b): a verified token costs at least V_IDLE of a one-row step
    a, b = cost.fixed, max(cost.per_token, cost.fixed * V_IDLE / (1.0 - V_IDLE))
    return (predicted_rate(alpha, coverage, k, rows, a, b)
            / predicted_rate(alpha, coverage, 0, rows, a, b))


def choose_k(alpha: float, k_max: int, load: float = 0.0, cost: StepCost | None = None,
             rows: float = 1.0, coverage: float = 1.0, margin: float = 0.0) -> int:
    """The K in 0..k_max with the best predicted rate (ties: the smaller K); K > 0
    only when it beats K = 0 by `margin`. cost None: modelled from load."""
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        s = speedup(alpha, k, load, cost, rows, coverage)
        if s > best + 1e-9:
            best_k, best = k, s
    return best_k if best >= 1.0 + margin else 0


@dataclasses.dataclass
class PoolView:
    """What the router knows about one draft pool."""

    name: str
    draft_tokens: int  # measured so far
    alpha: float  # conditional acceptance (stats.Figures.alpha)
    coverage: float  # share of target steps that found this pool's drafts waiting
    requests: int  # routed so far
    inflight: int  # requests using it now
    replicas: int = 1


def is_fresh(p: PoolView, th: Thresholds = Thresholds()) -> bool:
    """Too little measured to judge: a pool whose drafts never arrive in time
    stops being fresh after th.min_requests requests (its coverage is then 0)."""
    return p.draft_tokens < th.min_drafted_tokens and p.requests < th.min_requests


def pool_k(p: PoolView, k_max: int, load: float, cost: StepCost | None = None,
           rows: float = 1.0, th: Thresholds = Thresholds()) -> int:
    """The K a pool gets now (fresh pools are measured at k_max): its acceptance
    and coverage against the target's step cost (measured, or modelled from load)."""
    if is_fresh(p, th):
        return k_max
    return choose_k(p.alpha, k_max, load, cost, rows, p.coverage, th.margin)


def describe_cost(cost: StepCost | None, load: float, rows: float) -> str:
    if cost is None or not cost.measured:
        return f"modelled verify cost {verify_cost(load):.2f} step/token at load {load:.2f}"
    return (f"step {cost.fixed * 1e3:.1f} ms + {cost.per_token * 1e3:.2f} ms/token, "
            f"{rows:.0f} rows")


@dataclasses.dataclass
class Choice:
    pool: str | None
    k: int
    reason: str


def choose(pools: list[PoolView], k_max: int, load: float, turn: int,
           cost: StepCost | None = None, rows: float = 1.0,
           th: Thresholds = Thresholds()) -> Choice:
    """Draft pool and K for the next request.

    Pools without enough measurements are tried first (round-robin by turn),
    at full K. Otherwise the pool with the best predicted speedup (its
    acceptance and coverage against the target's step cost), discounted by how
    busy its replicas are, wins, with its own K. When no pool's K is above 0,
    one pool gets a probe at full K every th.probe_every turns so that a recovery
    (better acceptance or coverage, lighter load) is noticed; when not even a
    perfect draft would pay (saturated target), nobody speculates.
    """
    if not pools or k_max <= 0:
        return Choice(None, 0, "no draft pools")
    fresh = [p for p in pools if is_fresh(p, th)]
    if fresh:
        p = fresh[turn % len(fresh)]
        return Choice(p.name, k_max, f"measuring {p.name} ({p.draft_tokens} tokens so far)")

    def value(p: PoolView) -> tuple[float, int]:
        k = pool_k(p, k_max, load, cost, rows, th)
        gain = speedup(p.alpha, k, load, cost, rows, p.coverage) - 1.0
        busy = p.inflight / max(p.replicas, 1)
        return gain / (1.0 + 0.05 * busy), k

    scored = sorted(((value(p), p) for p in pools), key=lambda x: -x[0][0])
    (score, k), best = scored[0]
    how = describe_cost(cost, load, rows)
    if k > 0:
        return Choice(best.name, k, f"{best.name}: alpha {best.alpha:.2f}, "
                      f"coverage {best.coverage:.2f}, {how} -> K={k}")
    if choose_k(1.0, k_max, load, cost, rows) == 0:
        return Choice(None, 0, f"target saturated ({how}): no speculation")
    if turn % th.probe_every == 0:
        p = pools[(turn // th.probe_every) % len(pools)]
        return Choice(p.name, k_max, f"probing {p.name} (speculation did not pay; {how})")
    return Choice(None, 0, f"no pool's acceptance and coverage pay for speculation ({how})")
