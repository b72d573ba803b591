"""Step costs for the capacity simulator: what one step of each engine costs.

Owns `StepProfile` (step time as a piecewise-linear function of tokens or batch
size), the target's and the draft's costs (`TargetCost`, `DraftCost`) and the
`Profile` file format (`specserve-profile/1`, written by
`specserve.tools.measure`, read by `specserve simulate --profile`). Pure data
and arithmetic; not the router's per-step cost fit (that is
`specserve.control.policy.StepProfile`). Time is in milliseconds.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any


PROFILE_FORMAT = "specserve-profile/1"


# ---- costs ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Step time (ms) as a piecewise-linear function of x (tokens, or batch size),
    plus `per_seq_ms` per sequence in the batch. Past the last point it goes on
    along the last segment's slope; below the first point it is flat."""

    points: tuple[tuple[float, float], ...]
    per_seq_ms: float = 0.0

    def __post_init__(self):
        pts = tuple(sorted((float(x), float(y)) for x, y in self.points))
        if not pts:
            raise ValueError("a step cost needs at least one (x, ms) point")
        if any(y < 0 for _, y in pts) or self.per_seq_ms < 0:
            raise ValueError("step times must be >= 0")
        if len({x for x, _ in pts}) != len(pts):
            raise ValueError(f"step cost points repeat an x: {pts}")
        object.__setattr__(self, "points", pts)

    @classmethod
    def constant(cls, ms: float) -> "StepProfile":
        return cls(((1.0, ms),))

    def __call__(self, x: float, seqs: int = 0) -> float:
        pts = self.points
        if len(pts) == 1 or x <= pts[0][0]:
            y = pts[0][1]
        else:
            i = bisect.bisect_right([p[0] for p in pts], x)
            (x0, y0), (x1, y1) = pts[min(i, len(pts) - 1) - 1], pts[min(i, len(pts) - 1)]
            y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return max(y, 0.0) + self.per_seq_ms * seqs

    def to_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "per_seq_ms": self.per_seq_ms}

    @classmethod
    def from_dict(cls, d: Any, what: str) -> "StepProfile":
        if isinstance(d, (int, float)):
            return cls.constant(float(d))
        if not isinstance(d, dict) or "points" not in d:
            raise ValueError(f"{what}: expected a number of ms or {{'points': [[x, ms], ...]}}")
        return cls(tuple(tuple(p) for p in d["points"]), float(d.get("per_seq_ms", 0.0)))


@dataclasses.dataclass(frozen=True)
class TargetCost:
    step: StepProfile                     # x = query tokens in the step (1 + drafts per row)
    prefill_ms_per_token: float = 0.0  # added to the step that admits a request
    spec_overhead_ms: float = 0.0      # per step with a remote-draft proposer (K > 0)
    gpus: int = 1                      # GPUs per replica (TP), for the price
    max_num_seqs: int = 256
    max_prefill_tokens: int = 8192     # prompt tokens admitted per step (at least one prompt)


@dataclasses.dataclass(frozen=True)
class DraftCost:
    step: StepProfile                     # x = requests drafted in the step (one token each)
    prefill_ms_per_token: float = 0.0  # a new request's prompt, once
    restart_ms: float = 0.0            # a segment restart (rollback, or resuming after W)
    gpus: int = 1


@dataclasses.dataclass(frozen=True)
class DataPlaneCost:
    """The draft -> target data plane's own costs, as `specserve bench dataplane`
    measures them (x = rows in the target's step): propose() on the engine's
    step (added to every speculative step) and the round trip from verified
    tokens out to fresh drafts in, beyond the network (added to the
    verified -> draft -> target path, half each way)."""

    propose_ms: StepProfile
    round_trip_ms: StepProfile

    @classmethod
    def from_dict(cls, d: dict) -> "DataPlaneCost":
        return cls(StepProfile.from_dict(d.get("propose_ms", 0.0), "dataplane.propose_ms"),
                   StepProfile.from_dict(d.get("round_trip_ms", 0.0), "dataplane.round_trip_ms"))

    def to_dict(self) -> dict:
        return {"propose_ms": self.propose_ms.to_dict(),
                "round_trip_ms": self.round_trip_ms.to_dict()}


@dataclasses.dataclass(frozen=True)
class Profile:
    """Step costs of one target/draft pair on given hardware. JSON format
    `specserve-profile/1` (see docs/simulator.md):

        {"format": "specserve-profile/1", "source": "...",
         "target": {"step_ms": {"points": [[tokens, ms], ...], "per_seq_ms": 0},
                    "prefill_ms_per_token": 0.1, "spec_overhead_ms": 0, "gpus": 8,
                    "max_num_seqs": 256, "max_prefill_tokens": 8192},
         "draft": {"step_ms": {"points": [[batch, ms], ...]}, "prefill_ms_per_token": 0.01,
                   "restart_ms": 0, "gpus": 1},
         "colocated_draft": {"step_ms": {"points": [[batch, ms], ...]}},
         "dataplane": {"propose_ms": {"points": [[rows, ms], ...]},
                       "round_trip_ms": {"points": [[rows, ms], ...]}}}

    `colocated_draft` (optional): the draft's step on the target's GPUs at the
    target's TP, for the vLLM draft_model baseline. `dataplane` (optional):
    the data plane's costs by rows (DataPlaneCost; `make gpu-check` measures
    them with `specserve bench dataplane`). A step cost may also be a plain
    number of ms.
    """

    target: TargetCost
    draft: DraftCost | None = None
    colocated_draft: StepProfile | None = None
    source: str = ""
    dataplane: DataPlaneCost | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        if d.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
            raise ValueError(f"profile format {d.get('format')!r} is not {PROFILE_FORMAT!r}")
        if "target" not in d:
            raise ValueError("profile has no 'target' section")
        t = d["target"]
        target = TargetCost(
            step=StepProfile.from_dict(t.get("step_ms"), "target.step_ms"),
            prefill_ms_per_token=float(t.get("prefill_ms_per_token", 0.0)),
            spec_overhead_ms=float(t.get("spec_overhead_ms", 0.0)),
            gpus=int(t.get("gpus", 1)),
            max_num_seqs=int(t.get("max_num_seqs", 256)),
            max_prefill_tokens=int(t.get("max_prefill_tokens", 8192)),
        )
        draft = None
        if d.get("draft") is not None:
            x = d["draft"]
            draft = DraftCost(
                step=StepProfile.from_dict(x.get("step_ms"), "draft.step_ms"),
                prefill_ms_per_token=float(x.get("prefill_ms_per_token", 0.0)),
                restart_ms=float(x.get("restart_ms", 0.0)),
                gpus=int(x.get("gpus", 1)),
            )
        colo = None
        if d.get("colocated_draft") is not None:
            colo = StepProfile.from_dict(d["colocated_draft"].get("step_ms"), "colocated_draft.step_ms")
        plane = DataPlaneCost.from_dict(d["dataplane"]) if d.get("dataplane") else None
        return cls(target, draft, colo, str(d.get("source", "")), plane)

    def to_dict(self) -> dict:
        out: dict = {"format": PROFILE_FORMAT, "source": self.source,
                     "target": {"step_ms": self.target.step.to_dict(),
                                "prefill_ms_per_token": self.target.prefill_ms_per_token,
                                "spec_overhead_ms": self.target.spec_overhead_ms,
                                "gpus": self.target.gpus,
                                "max_num_seqs": self.target.max_num_seqs,
                                "max_prefill_tokens": self.target.max_prefill_tokens}}
        if self.draft is not None:
            out["draft"] = {"step_ms": self.draft.step.to_dict(),
                            "prefill_ms_per_token": self.draft.prefill_ms_per_token,
                            "restart_ms": self.draft.restart_ms, "gpus": self.draft.gpus}
        if self.colocated_draft is not None:
            out["colocated_draft"] = {"step_ms": self.colocated_draft.to_dict()}
        if self.dataplane is not None:
            out["dataplane"] = self.dataplane.to_dict()
        return out

