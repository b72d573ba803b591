"""Speculation policies: how many tokens to draft (K) and which draft pool to use.

Pure functions of measured figures; no Ray, no clock. This module owns the one
model of what speculation buys; `specserve.control.controller.KController`
decides with it for the Serve router and for LocalSpec alike.

A verify step over r decode rows, each with K drafted tokens, costs

    step_seconds = a + b · tokens + w,   tokens = r · (1 + cov · K)

(a: fixed cost per step, b: cost per processed token; `StepCost`; w: the
seconds per step the proposer held the target's steps for this pool's drafts,
the bounded wait, as measured per pool: `PoolView.wait_s`; 0 at K = 0, where
nothing is drafted). A row whose
drafts were waiting (share `cov`, the coverage, of its steps) emits on average
E(α, K) = (1 − α^(K+1)) / (1 − α) tokens (Leviathan et al.; α the measured
per-token acceptance), the others one, so the target's output rate is

    rate(K) = r · (1 + cov · (E(α, K) − 1)) / (a + b · r · (1 + cov · K) + w)

and speedup(K) = rate(K) / rate(0). The draft runs on other hardware, so its
own cost does not slow the target; it only limits coverage.

a and b are measured on the target (`specserve.control.stepcost.StepCostFit`, fed
by the target's sink, which times each step inside the engine, or else by
vLLM's step records: `specserve.target.engine.TargetEngine.step_cost`). Before
they are, the model stands in: one row, and a verified token costs v = V_IDLE + (1 − V_IDLE) · load of a step (small while
the target is memory-bound, 1 when it is saturated): a = 1 − v, b = v, which
gives speedup = E(α, K) / (1 + v K) at full coverage; w, in seconds, enters
only next to a measured a and b (the modelled cost has no seconds). A measured b is never
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

import numpy as np

V_IDLE = 0.05  # modelled marginal cost of one verified token at low load, in target steps


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When figures are trusted, how often to probe, how much gain is worth it
    (the config's `speculation.k_control`, specserve.config, describes each)."""

    min_drafted_tokens: int = 64  # drafted tokens before a pool's acceptance is trusted ...
    min_requests: int = 4  # ... unless this many requests went to it and drafted little
    min_steps: int = 32  # ... or (model pools) its requests took this many target steps
    probe_every: int = 16  # a pool held at K=0 is re-measured this many requests after its last at K>0,
    max_probe_every: int = 256  # ... twice as long after each probe that did not pay, up to this
    margin: float = 0.03  # speculate only when predicted this much faster (pool_margin)


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

    @classmethod
    def from_figures(cls, d: dict | None) -> "StepCost | None":
        """From the target's reported `step_cost` ({"fixed_s", "per_token_s", ...};
        specserve.target.engine.TargetEngine.step_cost); None until measured."""
        return None if d is None else cls(d["fixed_s"], d["per_token_s"])


def verify_cost(load: float, v_idle: float = V_IDLE) -> float:
    """Modelled cost of one more verified token, in steps of one row."""
    load = min(max(load, 0.0), 1.0)
    return v_idle + (1.0 - v_idle) * load


def modelled_cost(load: float, v_idle: float = V_IDLE) -> StepCost:
    """The stand-in before the target's step costs are measured (use with rows = 1)."""
    v = verify_cost(load, v_idle)
    return StepCost(1.0 - v, v, measured=False)


def token_cost(cost: StepCost) -> float:
    """b as the policy counts it: b >= V_IDLE · (a + b), a verified token costs
    at least V_IDLE of a one-row step (see the module docstring)."""
    return max(cost.per_token, cost.fixed * V_IDLE / (1.0 - V_IDLE))


def row_k(alpha: np.ndarray, k: np.ndarray, price: float) -> np.ndarray:
    """Per row, the drafted tokens worth verifying: the largest j <= k[i] with
    alpha[i]^j > price (0 if none).

    The marginal form of the rate model for one row of a running batch: the
    batch emits T tokens in a step of S seconds; one more drafted token on a
    row adds b seconds to the step and, accepted with probability α^j (its j-1
    predecessors and itself), α^j tokens. (T + α^j) / (S + b) > T / S exactly
    when α^j > b · T / S: the token pays when its chance of acceptance beats
    `price` = b × the batch's output rate (tokens per second). The sink prices
    each step from its measured b (`token_cost`) and rate, and each row's α
    from its own verify outcomes (`specserve.target.book_step`)."""
    alpha = np.clip(np.asarray(alpha, np.float64), 0.0, 1.0)
    k = np.asarray(k, np.int64)
    if price <= 0.0:
        return k.copy()
    if price >= 1.0:
        return np.zeros_like(k)
    with np.errstate(divide="ignore"):
        # α^j > price  <=>  j < log(price) / log(α)   (both logs negative)
        bound = np.log(price) / np.log(alpha)  # α = 0: 0 (-inf / -inf would be nan)
    bound = np.where(alpha <= 0.0, 0.0, np.where(alpha >= 1.0, np.inf, bound))
    # the largest integer j strictly below the bound
    j = np.where(np.isinf(bound), k, np.ceil(bound) - 1).astype(np.int64, copy=False)
    return np.clip(j, 0, k)


def predicted_rate(alpha: float, coverage: float, k: int, rows: float, a: float,
                   b: float, wait: float = 0.0) -> float:
    """Output tokens per second of the target with r rows speculating K; `wait`:
    seconds per step held for drafts (none at K = 0)."""
    tokens = rows * (1.0 + coverage * (expected_tokens(alpha, k) - 1.0))
    held = wait if k > 0 else 0.0
    return tokens / max(a + b * rows * (1.0 + coverage * k) + held, 1e-12)


def speedup(alpha: float, k: int, load: float = 0.0, cost: StepCost | None = None,
            rows: float = 1.0, coverage: float = 1.0, wait_s: float = 0.0) -> float:
    """rate(K) / rate(0), with the measured cost and the pool's wait per step
    `wait_s`, or the modelled cost for `load` (which has no seconds: wait_s unused)."""
    if cost is None:
        cost, rows = modelled_cost(load), 1.0
    wait = wait_s if cost.measured else 0.0
    a, b = cost.fixed, token_cost(cost)
    return (predicted_rate(alpha, coverage, k, rows, a, b, wait)
            / predicted_rate(alpha, coverage, 0, rows, a, b))


def choose_k(alpha: float, k_max: int, load: float = 0.0, cost: StepCost | None = None,
             rows: float = 1.0, coverage: float = 1.0, margin: float = 0.0,
             wait_s: float = 0.0) -> int:
    """The K in 0..k_max with the best predicted rate (ties: the smaller K); K > 0
    only when it beats K = 0 by `margin`. cost None: modelled from load."""
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        s = speedup(alpha, k, load, cost, rows, coverage, wait_s)
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
    steps: int = 0  # target steps of its finished requests (what its coverage is over)
    replicas: int = 1
    idle: int = 0  # requests routed since this pool last ran one at K > 0
    probes: int = 0  # probes since its figures last gave it K > 0
    wait_s: float = 0.0  # seconds per step the target held for its drafts (measured)
    collect_gap: int | None = None  # adapting pools: at most this many requests between
    #                                 their requests at K > 0 (adapt.collect_share), to learn from
    runs_model: bool = True  # False: a suffix memory, whose drafts cost no core and no wait


def probe_gap(probes: int, th: Thresholds = Thresholds()) -> int:
    """Requests between a pool's last request at K > 0 and its next probe, while
    its figures hold it at K = 0: th.probe_every, doubled by each probe that did
    not bring it back (`probes`), at most th.max_probe_every. A draft that does
    not pay is thus re-measured ever more rarely (at most 1/max_probe_every of
    the requests once it has failed a few probes) and a recovery is still seen."""
    return min(th.probe_every << min(max(probes, 0), 30), max(th.max_probe_every, th.probe_every))


def pool_gap(p: PoolView, th: Thresholds = Thresholds()) -> int:
    """A pool's probe gap; an adapting pool's is at most its collect gap: a
    draft that learns from the traffic it drafts for must keep getting some."""
    gap = probe_gap(p.probes, th)
    return min(gap, p.collect_gap) if p.collect_gap else gap


def is_fresh(p: PoolView, th: Thresholds = Thresholds()) -> bool:
    """Too little measured to judge: fewer than th.min_drafted_tokens drafted
    and fewer than th.min_requests requests. A model pool whose drafts seldom
    arrive in time drafts few tokens while its engine takes a core and the
    target waits for it, so it is judged sooner, once its requests took
    th.min_steps target steps (its coverage over them is known to within about
    ±0.09). A suffix memory costs neither, and whether it pays is a matter of
    its acceptance (its margin scales with coverage: pool_margin), which a few
    drafted tokens do not tell: the steps rule does not judge it."""
    return (p.draft_tokens < th.min_drafted_tokens and p.requests < th.min_requests
            and (p.steps < th.min_steps or not p.runs_model))


def pool_k(p: PoolView, k_max: int, load: float, cost: StepCost | None = None,
           rows: float = 1.0, th: Thresholds = Thresholds()) -> int:
    """The K a pool gets now (fresh pools are measured at k_max): its acceptance
    and coverage against the target's step cost (measured, or modelled from load)."""
    if is_fresh(p, th):
        return k_max
    return choose_k(p.alpha, k_max, load, cost, rows, p.coverage, pool_margin(p, th), p.wait_s)


def pool_margin(p: PoolView, th: Thresholds = Thresholds()) -> float:
    """The gain over K = 0 a pool's K > 0 must be predicted to bring.

    A model pool: th.margin. Its draft works on every step of its requests,
    and the target may wait for it, whether or not its drafts arrive in time
    (coverage), so what it costs beyond the rate model does not shrink with
    coverage. A suffix memory: th.margin × coverage, i.e. the steps it drafts
    for must be predicted th.margin faster. It costs nothing where it has no
    match, so its gain, and the error in it (from α and b), both scale with
    its coverage: one that matches 4 % of the steps well is not held at K = 0
    for a gain that can never exceed 4 %."""
    if p.runs_model:
        return th.margin
    return th.margin * min(max(p.coverage, 0.0), 1.0)


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
    probe: bool = False  # a pool held at K = 0, re-measured


def choose(pools: list[PoolView], k_max: int, load: float, turn: int,
           cost: StepCost | None = None, rows: float = 1.0,
           th: Thresholds = Thresholds()) -> Choice:
    """Draft pool and K for the next request.

    Pools without enough measurements are tried first (round-robin by turn),
    at full K. Otherwise the pool with the best predicted speedup (its
    acceptance and coverage against the target's step cost), discounted by how
    busy its replicas are, wins, with its own K. When no pool's K is above 0,
    a pool idle for `pool_gap` requests gets a probe at full K (the longest
    idle first) so that a recovery (better acceptance or coverage, lighter
    load, or an adapting pool's new weights) is noticed and an adapting pool
    keeps learning; when not even a perfect draft would pay (saturated
    target), nobody speculates.
    """
    if not pools or k_max <= 0:
        return Choice(None, 0, "no draft pools")
    fresh = [p for p in pools if is_fresh(p, th)]
    if fresh:
        p = fresh[turn % len(fresh)]
        return Choice(p.name, k_max, f"measuring {p.name} ({p.draft_tokens} tokens so far)")

    def value(p: PoolView) -> tuple[float, int]:
        k = pool_k(p, k_max, load, cost, rows, th)
        gain = speedup(p.alpha, k, load, cost, rows, p.coverage, p.wait_s) - 1.0
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
    due = [p for p in pools if p.idle >= pool_gap(p, th)]
    if due:
        p = max(due, key=lambda p: p.idle)
        return Choice(p.name, k_max, f"probing {p.name} after {p.idle} requests at K=0 "
                                     f"(speculation did not pay; {how})", probe=True)
    return Choice(None, 0, f"no pool's acceptance and coverage pay for speculation ({how})")


# ---- after a rejection: branches and the bounded wait -------------------------------
#
# A verify step ends in one of these outcomes for a row: its j-th drafted token
# (j = 0, 1, ...) is the first the target rejects, with probability
# P_j = α^j (1 − α), and the target's own token stands at that position. The
# next step finds drafts only if the draft had already drafted that outcome: a
# branch that forks at the position with the target's token. A draft that
# offers f alternatives at a position holds the target's token with a hit rate
# that grows with f and flattens (SSD / Saguaro, Kumar et al., ICLR 2026, fit it
# as a power law: miss ∝ f^(−r)). Maximising Σ_j P_j · hit(f_j) under a budget
# Σ_j f_j = B gives f_j ∝ P_j^(1/(1+r)) (their Theorem 12): the alternatives
# thin out geometrically with the offset, by α^(1/(1+r)) per position.

BRANCH_R = 0.5  # the power-law exponent r of the hit rate; SSD's default


def fan_out(alpha: float, positions: int, budget: int, max_fan_out: int,
            r: float = BRANCH_R) -> list[int]:
    """Alternatives to pre-draft at window offsets 0..positions-1 (offset j: the
    j-th drafted token past the verified position): at most max_fan_out each,
    at most `budget` in all, in proportion to P_j^(1/(1+r)) (D'Hondt rounding,
    so the split is the same integers every time). Non-increasing in j."""
    if positions <= 0 or budget <= 0 or max_fan_out <= 0:
        return [0] * max(positions, 0)
    a = min(max(alpha, 0.0), 1.0)
    rho = 1.0 / (1.0 + max(r, 0.0))
    # P_j^rho without the common factor (1 - a)^rho; a = 1 never rejects, but
    # keep the shape uniform there rather than dividing by zero.
    weights = [a ** (j * rho) if a > 0 else (1.0 if j == 0 else 0.0) for j in range(positions)]
    counts = [0] * positions
    for _ in range(min(budget, positions * max_fan_out)):
        best, best_q = -1, 0.0
        for j, w in enumerate(weights):
            if counts[j] < max_fan_out and w > 0:
                q = w / (counts[j] + 1)
                if q > best_q:
                    best, best_q = j, q
        if best < 0:
            break
        counts[best] += 1
    return counts


MAX_WAIT_S = 0.25  # no configuration waits longer than this per step
# The share of bounded waits whose rows should all have their fresh drafts by
# the deadline (see round_trip_percentile).
WAIT_ALL_IN = 0.9
# A wait is decided afresh each step and is bounded, so it only has to beat the
# noise of the step estimates, not the K controller's margin (which guards a
# decision held for whole requests).
WAIT_MARGIN = 0.01


def round_trip_percentile(waiting_rows: int, all_in: float = WAIT_ALL_IN) -> float:
    """The percentile of the draft's recent round trips to take as the deadline
    of a wait for `waiting_rows` rows, so that all of them are in by then with
    probability `all_in` (round trips taken as independent): 100 · all_in^(1/m).
    One row: the 90th percentile; eight: the 98.7th. A wait ends as soon as the
    drafts are in, so the later deadline costs only when drafts are late."""
    m = max(waiting_rows, 1)
    return 100.0 * all_in ** (1.0 / m)


def wait_bound(alpha: float, k: int, rows: int, waiting_rows: int, step_s: float,
               draft_token_s: float | None, cost: StepCost | None = None,
               coverage: float = 1.0, max_wait_s: float = MAX_WAIT_S,
               first_token_s: float | None = None,
               margin: float = WAIT_MARGIN) -> float:
    """Seconds the proposer may hold a verify step for fresh drafts.

    `waiting_rows` of the batch's `rows` just had a rejection and found no
    branch; the draft hears the target's token now and produces a token every
    `draft_token_s` seconds (measured: the first fresh draft after a
    rejection; the first of them `first_token_s` after the verified tokens
    went out, round trip included, when known). Waiting
    w_j = first_token_s + (j − 1) · draft_token_s (or j · draft_token_s) gives
    each of them j drafts, i.e.
    E(α, j) − 1 more tokens this step, and delays every row by as long: with a
    step of `step_s` seconds (a + b · tokens; a measured `cost` gives b, else
    b = V_IDLE · step_s), the batch emits

        X  = (rows − m) (1 + cov (E(α, K) − 1)) + m      tokens in step_s
        X' = X + m (E(α, j) − 1)                           in step_s + w_j + b·m·j

    The bound is the w_j with the best X'/time, if it beats X/step_s by
    `margin`; otherwise 0. So it is 0 for poor drafts, big batches (the others'
    delay outweighs), slow drafts and unknown draft speed; never above
    max_wait_s."""
    m = min(max(waiting_rows, 0), max(rows, 0))
    if m == 0 or k <= 0 or alpha <= 0.0 or step_s <= 0.0 or draft_token_s is None \
            or draft_token_s < 0.0 or max_wait_s <= 0.0:
        return 0.0
    if first_token_s is None:
        if draft_token_s <= 0.0:
            return 0.0
        first_token_s = draft_token_s
    if cost is not None and cost.measured:
        # As measured: the sink fits its own engine's steps at this batch, so the
        # V_IDLE floor (which stands in for costs a fit cannot see) is not needed.
        b = cost.per_token
    else:
        b = V_IDLE * step_s
    others = (rows - m) * (1.0 + min(max(coverage, 0.0), 1.0) * (expected_tokens(alpha, k) - 1.0))
    base = others + m
    best_w, best_rate = 0.0, base / step_s * (1.0 + margin)
    for j in range(1, k + 1):
        w = first_token_s + (j - 1) * draft_token_s
        if w > max_wait_s:
            break
        rate = (base + m * (expected_tokens(alpha, j) - 1.0)) / (step_s + w + b * m * j)
        if rate > best_rate:
            best_w, best_rate = w, rate
    return best_w
