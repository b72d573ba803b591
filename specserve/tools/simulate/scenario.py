"""What the capacity simulator simulates and what comes out of it.

Owns `Scenario` (pools, K, W, alpha, network, arrivals, objectives; `check`
fails fast with the fix), `Result` (throughput, goodput, latency percentiles,
coverage, acceptance, busy shares) and the price of a scenario
(`Prices`, `cost_per_hour`). Pure data; the event model is
`specserve.tools.simulate.model`.
"""

from __future__ import annotations

import dataclasses

from specserve.config import lookahead_problem

from specserve.tools.simulate.profile import Profile


# ---- scenario and result --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    targets: int = 1             # M target replicas
    drafts: int = 1              # N draft replicas (0: target-only, or co-located)
    k: int = 4                   # K: drafted tokens verified per request-step (0: no speculation)
    lookahead: int = 9           # W (2K + 1, the product default): how far a draft runs past the verified position it knows
    alpha: float = 0.8           # chance that a drafted token is the target's
    rtt_ms: float = 0.0          # draft <-> target network round trip
    concurrency: int | None = 8  # closed loop: this many requests in flight ...
    rate_per_s: float | None = None  # ... or Poisson arrivals at this rate
    requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    colocated: bool = False      # vLLM draft_model: the draft on the target's GPUs
    branch_hit: float = 0.0      # share of rejections whose outcome a branch pre-drafted
    branch_len: int | None = None  # tokens a branch continues (None: K)
    max_wait_ms: float = 0.0     # bounded wait after a rejection without a branch (0: none)
    seed: int = 0
    ttft_slo_ms: float = 2000.0  # goodput counts requests within both objectives
    tpot_slo_ms: float = 200.0

    def check(self, profile: Profile) -> None:
        """Fail fast with the fix, before simulating."""
        if self.targets < 1:
            raise ValueError("targets must be >= 1")
        if self.drafts < 0 or self.k < 0:
            raise ValueError("drafts and k must be >= 0")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 <= self.branch_hit <= 1.0:
            raise ValueError(f"branch_hit must be in [0, 1], got {self.branch_hit}")
        if self.max_wait_ms < 0 or (self.branch_len is not None and self.branch_len < 1):
            raise ValueError("max_wait_ms must be >= 0 and branch_len >= 1")
        if self.rtt_ms < 0:
            raise ValueError("rtt_ms must be >= 0")
        if (self.concurrency is None) == (self.rate_per_s is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate_per_s (Poisson)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError("rate_per_s must be > 0")
        if self.requests < 1 or self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("requests, prompt_len and output_len must be >= 1")
        if self.k > 0 and not self.colocated and self.drafts > 0:
            problem = lookahead_problem(self.k, self.lookahead, "K")
            if problem:
                raise ValueError(problem)
            if profile.draft is None:
                raise ValueError("the profile has no 'draft' section; add one or set drafts=0")
        if self.colocated and self.k > 0 and profile.colocated_draft is None:
            raise ValueError("co-located mode needs the profile's 'colocated_draft' step cost")
        if self.colocated and self.drafts:
            raise ValueError("co-located mode has no draft pool: set drafts=0")

    @property
    def mode(self) -> str:
        if self.k == 0:
            return "target_only"
        if self.colocated:
            return "colocated"
        return "disaggregated" if self.drafts > 0 else "target_only_with_proposer"


@dataclasses.dataclass
class Result:
    scenario: Scenario
    output_tokens: int
    makespan_ms: float
    throughput_tok_s: float
    goodput_tok_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    request_steps: int           # one verify/decode (or prefill) pass for one request
    steps_with_drafts: int
    drafted_tokens: int          # drafted tokens the target verified
    accepted_tokens: int
    target_steps: int            # batched forward passes, all target replicas
    target_busy: float           # share of time the target replicas were stepping
    draft_busy: float
    rollbacks: int
    cost_per_hour: float | None = None
    rejections: int = 0          # request-steps that rejected a drafted token
    branch_hits: int = 0         # ... whose next step found a pre-drafted branch
    waits: int = 0               # target steps held by the bounded wait
    wait_ms: float = 0.0         # ... in all

    @property
    def branch_hit_rate(self) -> float | None:
        return self.branch_hits / self.rejections if self.rejections else None

    @property
    def coverage(self) -> float:
        return self.steps_with_drafts / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / steps with drafts, as /v1/spec/stats reports it."""
        return 1.0 + self.accepted_tokens / self.steps_with_drafts if self.steps_with_drafts else 1.0

    @property
    def tokens_per_request_step(self) -> float:
        return self.output_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def goodput_tokens_per_dollar(self) -> float | None:
        if not self.cost_per_hour:
            return None
        return self.goodput_tok_s * 3600.0 / self.cost_per_hour

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "scenario"}
        d["scenario"] = dataclasses.asdict(self.scenario)
        d["mode"] = self.scenario.mode
        for name in ("coverage", "acceptance_rate", "mean_accepted_length",
                     "tokens_per_request_step", "goodput_tokens_per_dollar", "branch_hit_rate"):
            d[name] = getattr(self, name)
        return d



# ---- cost and sweeps ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prices:
    """GPU prices in dollars per GPU-hour."""
    target_gpu: float
    draft_gpu: float


def cost_per_hour(profile: Profile, sc: Scenario, prices: Prices) -> float:
    c = sc.targets * profile.target.gpus * prices.target_gpu
    if sc.k > 0 and not sc.colocated and sc.drafts > 0:
        c += sc.drafts * profile.draft.gpus * prices.draft_gpu
    return c

