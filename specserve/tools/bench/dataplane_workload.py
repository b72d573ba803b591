"""The pure parts of `specserve bench dataplane`: the workload, the emulated verify, the figures.

Owns the settings of a run (`Plan`, `DraftPlan`) and the flags that make
them (`add_arguments`, `plan_from_args`), the target's true
continuation of each emulated request (T_r, a seeded hash of (request,
position)), the emulated verification of a proposal against it, and turning
what a cell measured into its figures and the Markdown table. No processes,
no gRPC, no clock: `specserve/tools/bench/dataplane.py` runs the cells and
`specserve/tools/bench/dataplane_draft.py` the emulated drafts.

Every emulated request r has one true continuation T_r: the target's output,
whatever the drafts propose (the emulated target is greedy and its own
authority, as the real one is). The prompt is T_r's first tokens too, so the
whole history of a row is a prefix of T_r and a draft can compute any
position's truth from the request's seed alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from specserve.acceptance.record import percentile
from specserve.config.speculation import SpeculationConfig, lookahead_tokens

M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MAX_POSITION = 1 << 32  # positions and seeds share one 64-bit word: 32 bits each

ROWS = (8, 64, 256, 1024)
CONTEXTS = (1024, 8192, 32768)
QUICK_CELLS = ((256, 1024), (256, 8192), (256, 32768), (1024, 8192))
_SPEC = SpeculationConfig()  # the served defaults (fan-out, wait) the plan starts from


def true_token(seed: int, position: int, vocab: int) -> int:
    """T_r[position] of the request with this seed (splitmix64 of (seed, position))."""
    x = (((seed & 0xFFFFFFFF) << 32) ^ position) + _GOLDEN & M64
    x = (x ^ (x >> 30)) * _MIX1 & M64
    x = (x ^ (x >> 27)) * _MIX2 & M64
    return (x ^ (x >> 31)) % vocab


def true_tokens(seed: int, start: int, stop: int, vocab: int) -> np.ndarray:
    """T_r[start:stop] as int32, the same values as `true_token` (vectorized)."""
    if not 0 <= start <= stop <= MAX_POSITION:
        raise ValueError(f"positions must lie in [0, {MAX_POSITION}], got {start}..{stop}")
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as the hash wants
        x = (np.uint64((seed & 0xFFFFFFFF) << 32) ^ np.arange(start, stop, dtype=np.uint64)) \
            + np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX2)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.int32)


def accepted(proposal: Sequence[int], truth: Sequence[int]) -> int:
    """Drafted tokens a greedy target accepts: the proposal's leading matches of its truth."""
    n = 0
    for drafted, true in zip(proposal, truth):
        if drafted != true:
            break
        n += 1
    return n


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """What every emulated draft does (one per draft process, sent at start and per phase)."""

    k: int = 4  # the target's K; branches cover the K + 1 positions it can reject
    rate: float = 250.0  # drafted tokens per second per request; 0: as fast as the sender can
    alpha: float = 0.8  # A: each drafted token is T_r's with this probability
    recovery_hit: float = 0.6  # H: where a token is wrong, the alternatives hold T_r's
    fan_out: int = _SPEC.branch_fan_out  # F: alternatives per position, sent as branches
    branch_budget: int = _SPEC.branch_fan_out * 5  # alternatives per window (F × (K + 1))
    branch_len: int = 4  # tokens after a branch's alternative (K)
    lookahead: int = 9  # W: tokens past the verified position (2K + 1)
    draft_step_ms: float = 4.0  # one batched draft step: 1 token per request at 250/s
    vocab: int = 32000
    seed: int = 0  # of the corruption rule (specserve/draft/synthetic.py)

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run of the bench: the cells, the emulated engine step, the drafts."""

    cells: tuple[tuple[int, int], ...] = tuple((r, c) for r in ROWS for c in CONTEXTS)
    draft: DraftPlan = DraftPlan()
    step_ms: float = 20.0  # one emulated engine step without the proposer
    gil_ms: float = 2.0  # ... of which the model runner holds the GIL (launching kernels)
    output_tokens: int = 256  # each request's output: prompt = context - this
    prefill_tokens_per_step: int = 8192  # a new request's prompt, per engine step (chunked)
    duration_s: float = 10.0  # measured per cell, after the warm-up
    warmup_s: float = 2.0  # stepping with every request open before measuring
    baseline_s: float = 3.0  # the same loop without drafts or proposer
    drafts: int = 1  # draft processes (replicas), one stream each
    capacity_rows: int = 256  # the ingest-capacity cell (context: the smallest of the grid)
    max_wait_ms: float = _SPEC.max_wait_ms  # the sink's bounded wait, as served
    seed: int = 0

    @property
    def k(self) -> int:
        return self.draft.k


def make_plan(*, k: int = 4, rate: float = 250.0, alpha: float = 0.8, fan_out: int | None = None,
              lookahead: int | None = None, draft_step_ms: float | None = None,
              vocab: int = 32000, cells=None, **engine) -> Plan:
    """A Plan with the served defaults filled in (K-dependent ones from K); ValueError
    naming the flag when a value cannot run."""
    f = _SPEC.branch_fan_out if fan_out is None else fan_out
    w = lookahead_tokens(k, lookahead)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--alpha {alpha} is outside [0, 1]")
    if w <= k:
        raise ValueError(f"--lookahead {w} must be greater than K = {k}")
    if rate < 0:
        raise ValueError(f"--rate must be >= 0 (0: as fast as the senders can), got {rate}")
    step = draft_step_ms if draft_step_ms is not None else (1000.0 / rate if rate > 0 else 0.0)
    draft = DraftPlan(k=k, rate=rate, alpha=alpha, fan_out=f, branch_budget=f * (k + 1),
                      branch_len=max(k, 1), lookahead=w, draft_step_ms=step, vocab=vocab)
    plan = Plan(cells=tuple(cells) if cells is not None else Plan.cells, draft=draft, **engine)
    if plan.gil_ms > plan.step_ms:
        raise ValueError(f"--gil-ms {plan.gil_ms} is more than the step, --step-ms {plan.step_ms}")
    for rows, context in plan.cells:
        if context <= plan_output(plan, context) or context >= MAX_POSITION:
            raise ValueError(f"context {context} leaves no prompt for --output-tokens "
                             f"{plan.output_tokens}")
    return plan


def plan_output(plan: Plan, context: int) -> int:
    """Output tokens of one request in a cell: at most half its context."""
    return max(1, min(plan.output_tokens, context // 2))


# ---- figures ------------------------------------------------------------------------


def _ms(values: Sequence[float], q: float) -> float | None:
    v = percentile(values, q)
    return None if v is None else round(v * 1000.0, 3)


def _rate(n: float, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else 0.0


def cell_figures(rows: int, context: int, k: int, *, propose_s: Sequence[float],
                 steps_s: Sequence[float], baseline_steps_s: Sequence[float],
                 waits_s: Sequence[float] = (),
                 round_trips_s: Sequence[float], missed_round_trips: int,
                 sink_delta: dict, seconds: float, drafts_delta: dict, drafts_seconds: float,
                 rss_mb: float, gained: int, verify_steps: int, cpu_s: float = 0.0,
                 legs: tuple[Sequence[float], Sequence[float]] = ((), ())) -> dict:
    """One cell's figures (the JSON's documented keys first, then the context to read them).
    waits_s[i]: the sink's bounded wait within propose_s[i] (0: it did not wait)."""
    mean = sum(steps_s) / len(steps_s) if steps_s else None
    waits = list(waits_s) or [0.0] * len(propose_s)
    work = [p - w for p, w in zip(propose_s, waits)]
    base = sum(baseline_steps_s) / len(baseline_steps_s) if baseline_steps_s else None
    seen = sink_delta.get("rows_seen", 0)
    return {
        "rows": rows, "context": context, "k": k,
        "propose_p50_ms": _ms(propose_s, 50), "propose_p99_ms": _ms(propose_s, 99),
        "loop_slowdown": round(mean / base, 4) if mean and base else None,
        "offered_tokens_per_s": _rate(drafts_delta.get("drafted_tokens", 0), drafts_seconds),
        "ingest_tokens_per_s": _rate(sink_delta.get("draft_tokens_buffered", 0), seconds),
        "round_trip_p50_ms": _ms(round_trips_s, 50), "round_trip_p99_ms": _ms(round_trips_s, 99),
        "draft_sender_tokens_per_s": _rate(drafts_delta.get("wire_tokens", 0), drafts_seconds),
        "rss_mb_per_1k_requests": round(rss_mb / rows * 1000.0, 1),
        # to read the above
        # propose() without the bounded wait (its own work: the lock, the book,
        # the verified batches), and the steps it held for fresh drafts
        "propose_work_p50_ms": _ms(work, 50), "propose_work_p99_ms": _ms(work, 99),
        "steps_waited": sum(1 for w in waits if w > 0),
        "wait_p99_ms": _ms([w for w in waits if w > 0], 99),
        "step_ms": round(mean * 1000.0, 3) if mean else None,
        "baseline_step_ms": round(base * 1000.0, 3) if base else None,
        "steps": len(steps_s),
        "tokens_per_step": round(gained / verify_steps, 3) if verify_steps else None,
        "coverage": round(sink_delta.get("rows_with_proposals", 0) / seen, 4) if seen else None,
        "round_trips": len(round_trips_s), "round_trips_unanswered": missed_round_trips,
        # the round trip's legs: propose() -> the draft has the update -> its answer in the book
        "to_draft_p50_ms": _ms(legs[0], 50), "to_draft_p99_ms": _ms(legs[0], 99),
        "from_draft_p50_ms": _ms(legs[1], 50), "from_draft_p99_ms": _ms(legs[1], 99),
        "draft_messages_per_s": _rate(drafts_delta.get("messages", 0), drafts_seconds),
        "sink_draft_messages_per_s": _rate(sink_delta.get("draft_messages", 0), seconds),
        "stale_messages": sink_delta.get("stale_messages", 0),
        "sender_dropped_messages": drafts_delta.get("dropped", 0),
        "draft_rollbacks": drafts_delta.get("rollbacks", 0),
        "draft_branches_taken": drafts_delta.get("branches_taken", 0),
        # CPU cores busy: this machine's cores are shared by both sides (and more)
        "target_process_cpu_cores": round(cpu_s / seconds, 2) if seconds > 0 else None,
        "draft_processes_cpu_cores": round(drafts_delta.get("cpu_s", 0.0) / drafts_seconds, 2)
        if drafts_seconds > 0 else None,
        "seconds": round(seconds, 2),
    }


def minus(after: dict, before: dict) -> dict:
    """Counter deltas (numbers only)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


COLUMNS = (("rows", "rows"), ("context", "context"), ("propose_p50_ms", "propose p50 ms"),
           ("propose_p99_ms", "p99 ms"), ("loop_slowdown", "loop slowdown"),
           ("offered_tokens_per_s", "offered tok/s"), ("ingest_tokens_per_s", "ingest tok/s"),
           ("round_trip_p50_ms", "round trip p50 ms"), ("round_trip_p99_ms", "p99 ms"),
           ("draft_sender_tokens_per_s", "sender wire tok/s"),
           ("rss_mb_per_1k_requests", "RSS MB/1k req"), ("coverage", "coverage"),
           ("tokens_per_step", "tokens/step"), ("load_average_1m", "load"))


def markdown(report: dict) -> str:
    """The cells as a Markdown table, then the ingest capacity."""
    head = "| " + " | ".join(t for _, t in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, rule]
    for c in report["cells"]:
        lines.append("| " + " | ".join(_cell(c.get(key)) for key, _ in COLUMNS) + " |")
    cap = report.get("ingest_capacity_tokens_per_s")
    lines.append("")
    lines.append(f"ingest capacity: {_cell(cap)} tokens/s" + (
        f" (rows {report['capacity']['rows']}, context {report['capacity']['context']}, "
        f"offered {_cell(report['capacity']['offered_tokens_per_s'])} tokens/s)"
        if report.get("capacity") else ""))
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


# ---- the command's flags --------------------------------------------------------------

QUICK = {"duration_s": 8.0, "warmup_s": 2.0, "baseline_s": 3.0}


def add_arguments(p, positive_int, non_negative_float) -> None:
    """`specserve bench dataplane`'s flags (the parser is specserve/cli/parser.py)."""
    p.add_argument("--rows", type=positive_int("rows"), nargs="+",
                   help=f"batch rows of the emulated engine (default {' '.join(map(str, ROWS))})")
    p.add_argument("--context", type=positive_int("context"), nargs="+",
                   help="context length of every request: prompt + output (default "
                   f"{' '.join(map(str, CONTEXTS))}); the grid is rows x context")
    p.add_argument("--quick", action="store_true",
                   help="the cells (rows, context) " + " ".join(f"({r}, {c})" for r, c in
                                                              QUICK_CELLS)
                   + f" at {QUICK['duration_s']:g} s each (--rows/--context override the cells)")
    p.add_argument("--json", dest="json_path", help="write the figures as JSON to this file")
    p.add_argument("--num-speculative-tokens", "-k", dest="k",
                   type=positive_int("num-speculative-tokens"), default=4, help="K (default 4)")
    p.add_argument("--rate", type=non_negative_float("rate"), default=250.0,
                   help="drafted tokens per second per request (default 250; 0: as fast as "
                   "the senders can)")
    p.add_argument("--alpha", type=non_negative_float("alpha"), default=0.8,
                   help="A: each drafted token is the target's with this probability (default 0.8)")
    p.add_argument("--fan-out", type=int, choices=range(0, 17), metavar="F", default=None,
                   help="alternatives per drafted position, sent as branches (default: the "
                   "served speculation.branch_fan_out, 3; 0: none)")
    p.add_argument("--lookahead", type=positive_int("lookahead"), default=None,
                   help="W: how far past the verified position drafts run (default 2K + 1)")
    p.add_argument("--draft-step-ms", type=non_negative_float("draft-step-ms"), default=None,
                   help="one batched draft step, ms (default 1000 / rate: one token per "
                   "request per step)")
    p.add_argument("--step-ms", type=non_negative_float("step-ms"), default=20.0,
                   help="the emulated engine step without the proposer, ms (default 20)")
    p.add_argument("--gil-ms", type=non_negative_float("gil-ms"), default=2.0,
                   help="of which the model runner holds the GIL, ms (default 2)")
    p.add_argument("--duration", type=non_negative_float("duration"), default=None,
                   help="seconds measured per cell (default 10; --quick 8)")
    p.add_argument("--warmup", type=non_negative_float("warmup"), default=None,
                   help="seconds stepping with every request open before measuring (default 2)")
    p.add_argument("--baseline", type=non_negative_float("baseline"), default=None,
                   help="seconds of the same loop without drafts or proposer (default 3)")
    p.add_argument("--output-tokens", type=positive_int("output-tokens"), default=256,
                   help="output per request, the rest of the context is its prompt (default "
                   "256, at most half the context); a finished row gets a new request")
    p.add_argument("--prefill-tokens-per-step", type=positive_int("prefill-tokens-per-step"),
                   default=8192, help="a new request prefills this many prompt tokens per "
                   "engine step, sampling nothing, before it decodes (default 8192)")
    p.add_argument("--drafts", type=positive_int("drafts"), default=1,
                   help="draft processes (replicas, one stream each; default 1)")
    p.add_argument("--capacity-rows", type=positive_int("capacity-rows"), default=256,
                   help="rows of the ingest-capacity cell (default 256)")
    p.add_argument("--no-capacity", action="store_true", help="skip the ingest-capacity cell")
    p.add_argument("--max-wait-ms", type=non_negative_float("max-wait-ms"), default=None,
                   help="the sink's bounded wait (default: the served "
                   "speculation.max_wait_ms, 50)")
    p.add_argument("--seed", type=int, default=0)


def plan_from_args(args) -> Plan:
    """The Plan the flags ask for; ValueError naming the flag otherwise."""
    if args.quick and not (args.rows or args.context):
        cells = QUICK_CELLS
    else:
        cells = tuple((r, c) for r in (args.rows or ROWS) for c in (args.context or CONTEXTS))
    preset = QUICK if args.quick else {"duration_s": 10.0, "warmup_s": 2.0, "baseline_s": 3.0}

    def pick(flag, key):
        return preset[key] if flag is None else flag

    if args.alpha > 1.0:
        raise ValueError(f"--alpha {args.alpha} is outside [0, 1]")
    engine = {"duration_s": pick(args.duration, "duration_s"),
              "warmup_s": pick(args.warmup, "warmup_s"),
              "baseline_s": pick(args.baseline, "baseline_s")}
    if engine["duration_s"] <= 0 or engine["baseline_s"] <= 0:
        raise ValueError("--duration and --baseline must be > 0")
    if args.step_ms <= 0:
        raise ValueError("--step-ms must be > 0")
    if args.max_wait_ms is not None:
        engine["max_wait_ms"] = args.max_wait_ms
    return make_plan(k=args.k, rate=args.rate, alpha=args.alpha, fan_out=args.fan_out,
                     lookahead=args.lookahead, draft_step_ms=args.draft_step_ms, cells=cells,
                     step_ms=args.step_ms, gil_ms=args.gil_ms, output_tokens=args.output_tokens,
                     prefill_tokens_per_step=args.prefill_tokens_per_step,
                     drafts=args.drafts, capacity_rows=args.capacity_rows, seed=args.seed,
                     **engine)
