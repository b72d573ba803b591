"""`specserve simulate`: the command-line edge of the capacity simulator.

Owns the arguments, reading a profile file, and printing (a Markdown table, or
one JSON object with --json). The model itself is `specserve.tools.simulate.model` (pure);
measuring a profile is `specserve.tools.measure` (run by `specserve.tools.gpucheck`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.config import lookahead_tokens
from specserve.tools.simulate.model import simulate, sweep
from specserve.tools.simulate.profile import DraftCost, Profile, StepProfile, TargetCost
from specserve.tools.simulate.scenario import Prices, Result, Scenario, cost_per_hour


def _int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {s!r}")
    return out


def add_parser(sub) -> None:
    s = sub.add_parser(
        "simulate", help="capacity simulator: draft/target pools, K, W, alpha, RTT (no engine)",
        description="Discrete-event model of N draft replicas and M target replicas. Costs come "
        "from --profile (JSON, specserve-profile/1; `python -m specserve.tools.gpucheck` measures one) or "
        "from constant step times given as flags. With --sweep-drafts/--sweep-k it finds the draft "
        "replica count and K with the best goodput per dollar.")
    s.add_argument("--profile", help="profile JSON (specserve-profile/1)")
    s.add_argument("--target-step-ms", type=float, help="constant target step time (no profile)")
    s.add_argument("--draft-step-ms", type=float, help="constant draft step time (no profile)")
    s.add_argument("--colocated-draft-step-ms", type=float,
                   help="constant co-located draft step time on the target's GPUs (no profile)")
    s.add_argument("--targets", type=int, default=1, help="M target replicas (default 1)")
    s.add_argument("--drafts", type=int, default=1, help="N draft replicas (default 1)")
    s.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=4)
    s.add_argument("--lookahead", type=int, default=None, help="W (default 2K + 1, as the product)")
    s.add_argument("--alpha", type=float, default=0.8, help="acceptance per drafted token")
    s.add_argument("--rtt-ms", type=float, default=0.0, help="draft <-> target round trip")
    s.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: requests in flight (default 8 unless --rate)")
    s.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    s.add_argument("--requests", type=int, default=64)
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--colocated", action="store_true",
                   help="vLLM draft_model baseline: the draft on the target's GPUs")
    s.add_argument("--branch-hit", type=float, default=0.0,
                   help="share of rejections a pre-drafted branch covers (measured: the "
                        "bench's branch_hit_rate; default 0: no branches)")
    s.add_argument("--branch-len", type=int, default=None, help="tokens per branch (default K)")
    s.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="bounded wait after a rejection without a branch (default 0: none)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    s.add_argument("--tpot-slo-ms", type=float, default=200.0)
    s.add_argument("--sweep-drafts", type=_int_list, help="e.g. 1,2,4,8: draft replica counts")
    s.add_argument("--sweep-k", type=_int_list, help="e.g. 0,2,4,6: K values (0 = target only)")
    s.add_argument("--target-gpu-price", type=float, default=None, help="$ per target GPU-hour")
    s.add_argument("--draft-gpu-price", type=float, default=None, help="$ per draft GPU-hour")
    s.add_argument("--json", action="store_true", help="print one JSON object")


def load_profile(args) -> Profile:
    if args.profile:
        path = Path(args.profile)
        if not path.is_file():
            raise ValueError(f"profile {path} does not exist; measure one with "
                             "`python -m specserve.tools.gpucheck` (docs/simulator.md)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path} is not JSON: {e}") from None
        return Profile.from_dict(data)
    if args.target_step_ms is None:
        raise ValueError("give --profile FILE or --target-step-ms MS (and --draft-step-ms MS)")
    draft = (DraftCost(StepProfile.constant(args.draft_step_ms))
             if args.draft_step_ms is not None else None)
    colo = (StepProfile.constant(args.colocated_draft_step_ms)
            if args.colocated_draft_step_ms is not None else None)
    return Profile(TargetCost(StepProfile.constant(args.target_step_ms)), draft, colo,
                   source="constant step times from the command line")


def scenario_from_args(args) -> Scenario:
    concurrency = args.concurrency
    if concurrency is None and args.rate is None:
        concurrency = 8
    lookahead = lookahead_tokens(args.k, args.lookahead)
    return Scenario(
        targets=args.targets, drafts=0 if args.colocated else args.drafts, k=args.k,
        lookahead=lookahead, alpha=args.alpha, rtt_ms=args.rtt_ms,
        concurrency=concurrency, rate_per_s=args.rate, requests=args.requests,
        prompt_len=args.prompt_len, output_len=args.output_len, colocated=args.colocated,
        seed=args.seed, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
        branch_hit=args.branch_hit, branch_len=args.branch_len, max_wait_ms=args.max_wait_ms)


HEADER = ("| mode | M | N | K | W | tok/s | goodput tok/s | TPOT p50/p99 ms | TTFT p50/p99 ms "
          "| coverage | accept | mean acc. len | $/h | goodput tok/$ |")


def table_row(r: Result) -> str:
    sc = r.scenario
    cost = "" if r.cost_per_hour is None else f"{r.cost_per_hour:.2f}"
    per_dollar = r.goodput_tokens_per_dollar
    per_dollar = "" if per_dollar is None else f"{per_dollar:,.0f}"
    w = sc.lookahead if sc.mode == "disaggregated" else "-"
    return (f"| {sc.mode} | {sc.targets} | {sc.drafts} | {sc.k} | {w} "
            f"| {r.throughput_tok_s:.1f} | {r.goodput_tok_s:.1f} "
            f"| {r.tpot_ms['p50']:.2f} / {r.tpot_ms['p99']:.2f} "
            f"| {r.ttft_ms['p50']:.1f} / {r.ttft_ms['p99']:.1f} "
            f"| {r.coverage:.2f} | {r.acceptance_rate:.2f} | {r.mean_accepted_length:.2f} "
            f"| {cost} | {per_dollar} |")


def run(args) -> int:
    try:
        profile = load_profile(args)
        base = scenario_from_args(args)
        if args.sweep_drafts or args.sweep_k:
            if args.target_gpu_price is None or args.draft_gpu_price is None:
                raise ValueError("a sweep ranks by goodput per dollar: give --target-gpu-price "
                                 "and --draft-gpu-price ($ per GPU-hour)")
            results = sweep(profile, base, args.sweep_drafts or [base.drafts],
                            args.sweep_k or [base.k],
                            Prices(args.target_gpu_price, args.draft_gpu_price),
                            colocated=profile.colocated_draft is not None)
        else:
            base.check(profile)
            r = simulate(profile, base)
            if args.target_gpu_price is not None and args.draft_gpu_price is not None:
                r.cost_per_hour = cost_per_hour(
                    profile, base, Prices(args.target_gpu_price, args.draft_gpu_price))
            results = [r]
    except ValueError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"profile": profile.to_dict(), "results": [r.to_dict() for r in results]}
        if len(results) > 1:
            b = results[0]
            out["best"] = {"drafts": b.scenario.drafts, "targets": b.scenario.targets,
                           "draft_to_target_ratio": b.scenario.drafts / b.scenario.targets,
                           "k": b.scenario.k, "mode": b.scenario.mode,
                           "goodput_tokens_per_dollar": b.goodput_tokens_per_dollar}
        print(json.dumps(out))
        return 0
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for r in results:
        print(table_row(r))
    if len(results) > 1:
        b = results[0]
        print(f"\nbest goodput per dollar: {b.scenario.mode}, K={b.scenario.k}, "
              f"{b.scenario.drafts} draft replica(s) per {b.scenario.targets} target replica(s) "
              f"(ratio {b.scenario.drafts / b.scenario.targets:g}), "
              f"{b.goodput_tokens_per_dollar:,.0f} goodput tokens per $")
    return 0
