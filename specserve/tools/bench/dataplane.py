"""`specserve bench dataplane`: the draft -> target data plane alone, no model, no GPU.

Owns the run: building the real proposer and sink in this process (the target
worker's arrangement: `RemoteDraftProposer` with its `DraftSink`, a gRPC server
on threads beside the engine loop), starting the emulated draft replicas in
their own processes (`specserve/tools/bench/dataplane_draft.py`, each a real
`SinkLink`), and the cells. The workload and the figures are pure
(`specserve/tools/bench/dataplane_workload.py`).

The emulated engine loop is `specserve/tools/bench/dataplane_loop.py`
(`propose()`, the emulated verification, the GIL held, the GPU slept);
`loop_slowdown` compares its mean step with proposer and drafts against the
same loop without them.

How requests start and end is here, under "seams", as the target's engine
client does it: `start_request` registers the request with the sink (id,
prompt, K, end, a fresh ticket) and hands it to its draft with the ticket (the
draft side is `dataplane_draft.open_request`); `end_request` closes the draft
and unregisters; `attach` gives the proposer the loop's input batch (rows by
vLLM request id); `_Watch` (the round-trip timing) wraps the book's
`propose_rows` and `extend_batch`; `build_proposer` hands the sink its
settings as `TargetEngine.start` does (`SinkSettings`).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import dataclasses
import gc
import os
import secrets
import sys
import time
import types

from specserve.tools.bench.dataplane_draft import MAX_HEARD, DraftProcesses
from specserve.tools.bench.dataplane_loop import EngineLoop, calibrate_gil
from specserve.tools.bench.dataplane_workload import Plan, cell_figures, minus, true_tokens

OPEN_TIMEOUT_S = 120.0  # every request of a cell open in the sink (1 024 long prompts)
CLOSE_TIMEOUT_S = 30.0
UNANSWERED_S = 2.0  # a verified update with no answer by then is counted unanswered
MAX_HANDED = 500_000  # verified updates remembered per cell for the round trip's legs
SINK_MAX_PENDING = 64  # drafted tokens the sink buffers per request (its served default)
# The capacity cell's unthrottled senders send a batch per loop turn: far more
# than a real draft step's rate, so the stream bound is lifted for the bench.
MAX_STREAM_MESSAGES_PER_S = 1_000_000


def progress(msg: str) -> None:
    print(f"[dataplane {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mb() -> float:
    """This process's resident memory, after handing free heap pages back (glibc's
    malloc_trim), so that memory an earlier cell freed does not hide growth."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---- the real proposer, built without vLLM's engine ----------------------------------


def build_proposer(plan: Plan, max_model_len: int):
    """`RemoteDraftProposer` and its sink as vLLM's worker builds them (TP rank 0),
    settings through the environment as `TargetEngine.start` sets them."""
    from unittest import mock

    from specserve.target import proposer as prop
    from specserve.target.sink_settings import ENV as SINK_ENV
    from specserve.target.sink_settings import SinkSettings

    # What the proposer reads of vLLM's VllmConfig.
    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=plan.k),
        model_config=types.SimpleNamespace(get_vocab_size=lambda: plan.draft.vocab,
                                           max_model_len=max_model_len))
    env = SinkSettings("127.0.0.1:0", max_pending=SINK_MAX_PENDING,
                       max_wait_ms=plan.max_wait_ms,
                       max_stream_messages_per_s=MAX_STREAM_MESSAGES_PER_S,
                       # every row proposes its K, so the plane carries what the
                       # cells name (the emulated step's cost does not vary)
                       per_request_k=False).to_env()
    saved = {SINK_ENV: os.environ.get(SINK_ENV)}
    os.environ.update(env)
    try:
        proposer = prop.RemoteDraftProposer(config)  # applies vllm_fixes: imports vLLM
        # Outside a vLLM worker there is no tensor-parallel group; this process is rank 0.
        with mock.patch("vllm.distributed.get_tensor_model_parallel_rank", return_value=0):
            proposer.load_model()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if proposer.sink is None:
        raise RuntimeError("the proposer started no sink")
    return proposer


# ---- seams: what the registered, id-keyed plane changes ------------------------------


def start_request(sink, drafts: DraftProcesses, rid: str, seed: int, n_prompt: int, end: int,
                  k: int, vocab: int) -> None:
    """Start one request's drafting, as the target's engine client does
    (`DraftingEngine._open_drafts`): register it with the sink (its prompt, K,
    end and a fresh ticket), then hand it to its draft with the ticket."""
    ticket = secrets.token_urlsafe(16)
    sink.register(rid, true_tokens(seed, 0, n_prompt, vocab).tolist(), ticket, k=k, end=end)
    drafts.start(rid, seed, n_prompt, end, k, ticket)


def end_request(sink, drafts: DraftProcesses, rid: str) -> None:
    """A request left the batch: its draft closes it and the target unregisters it."""
    drafts.stop(rid)
    sink.unregister(rid)


def attach(proposer, batch) -> None:
    """Hand the proposer vLLM's input batch (rows by vLLM request id), as the
    worker hook does (`SinkWorkerExtension`)."""
    proposer.attach_batch(batch)


class _Watch:
    """Round trips: a verified update out of propose() -> the draft's first message
    for that request into the book after the draft heard the update (its answer,
    built on the new verified position). Drafts go out as deltas, so a message's
    position does not say what the draft had heard: the draft processes note when
    each update reached them (`DraftProcesses.heard`), and the answers are
    matched at the end of the measured window (`measure`).

    Wraps the sink's book's `propose_rows` (to see the verified batches it hands
    out, and when) and `extend_batch` (to note when a message for each request
    arrives). Both wrappers cost a clock read and a list append per request, in
    the same threads as the calls they wrap."""

    def __init__(self, sink):
        book = sink._book
        self._propose, self._extend = book.propose_rows, book.extend_batch
        book.propose_rows, book.extend_batch = self._on_propose, self._on_extend
        self.handed: list = []  # (updates, when), drained by collect()
        self.handed_out: list[tuple] = []  # (request id, end, sent): every update in the window
        self.arrivals: dict = {}  # key -> array of when its messages reached the book

    def _on_propose(self, *args, **kwargs):
        proposals, verified = self._propose(*args, **kwargs)
        if len(verified):
            self.handed.append((verified, time.monotonic()))
        return proposals, verified

    def _on_extend(self, stream, keys, positions, *args, **kwargs):
        now = time.monotonic()
        arrivals = self.arrivals
        for key in keys:
            got = arrivals.get(key)
            if got is None:
                got = arrivals[key] = array.array("d")
            got.append(now)
        return self._extend(stream, keys, positions, *args, **kwargs)

    def collect(self, now: float) -> None:
        """Note the updates handed out since the last call (called between steps)."""
        handed, self.handed = self.handed, []
        for verified, when in handed:
            for key, end in zip(verified.keys, (verified.positions + verified.counts).tolist()):
                if len(self.handed_out) < MAX_HANDED:
                    self.handed_out.append((key, end, when))

    def reset(self) -> None:
        """The measured window starts: what came before is forgotten."""
        self.handed, self.handed_out, self.arrivals = [], [], {}

    def measure(self, heard: dict, until: float, heard_complete: bool = True) -> dict:
        """The round trips of the updates handed out in the window, and their
        legs (sink -> draft for every update the draft got; draft -> book for
        the answered ones). heard: (request id, end) -> when the update reached
        its draft (heard_complete: every arrival is in it; else one missing
        from it says nothing). An update handed out at least UNANSWERED_S
        before `until` with no answer within UNANSWERED_S is unanswered."""
        trips, out, back, unanswered = [], [], [], 0
        for rid, end, sent in self.handed_out:
            got = heard.get((rid, end), -1.0)
            if got >= sent:
                out.append(got - sent)
            answer = None
            arrivals = self.arrivals.get(rid)
            if got >= sent and arrivals is not None:
                i = bisect.bisect_left(arrivals, got)
                if i < len(arrivals):
                    answer = arrivals[i]
            if answer is not None and answer - sent <= UNANSWERED_S:
                trips.append(answer - sent)
                back.append(answer - got)
            elif sent <= until - UNANSWERED_S and (got >= sent or heard_complete):
                unanswered += 1
        return {"round_trips": trips, "unanswered": unanswered, "to_draft": out,
                "from_draft": back}


# ---- cells ----------------------------------------------------------------------------


def _open(sink) -> int:
    """Requests a draft has attached to (registered ones wait for their draft)."""
    return int(sink.stats()["attached_requests"])


def _registered(sink) -> int:
    return int(sink.stats()["open_requests"])


def run_cell(rows: int, context: int, plan: Plan, proposer, drafts: DraftProcesses,
             watch: _Watch, gil_work: int, label: str) -> dict:
    sink = proposer.sink
    # The loop without proposer and drafts, half before and half after the
    # measured window: a shared machine's load drifts, and the slowdown is a ratio.
    baseline_steps = _baseline(rows, context, plan, gil_work, plan.baseline_s / 2)
    loop = EngineLoop(
        rows, context, plan, gil_work, proposer, rng_seed=plan.seed,
        on_start=lambda rid, seed, known, end, k: start_request(
            sink, drafts, rid, seed, known, end, k, plan.draft.vocab),
        on_end=lambda rid: end_request(sink, drafts, rid))
    attach(proposer, loop.batch)
    rss0 = rss_mb()  # the loop's own arrays included: the growth is the plane's
    t_open = time.monotonic()
    loop.start_all()
    between = lambda: watch.collect(time.monotonic())  # noqa: E731
    loop.run_for(OPEN_TIMEOUT_S, between, until=lambda: _open(sink) >= rows)
    if _open(sink) < rows:
        raise RuntimeError(f"{label}: only {_open(sink)} of {rows} requests opened in the sink "
                           f"in {OPEN_TIMEOUT_S:.0f} s")
    loop.activate_all()
    progress(f"{label}: {rows} requests open in {time.monotonic() - t_open:.1f} s; warming up")
    loop.run_for(plan.warmup_s, between)
    rss1 = rss_mb()
    d0, td0 = drafts.report(f"{label}/0")
    drafts.heard(f"{label}/0")  # (forgets what came before the measured window)
    s0, t0, cpu0 = sink.stats(), time.monotonic(), time.process_time()
    watch.reset()
    g0, v0, w0 = loop.gained, loop.verify_steps, len(loop.waits)
    steps, proposes = loop.run_for(plan.duration_s, between)
    waits = loop.waits[w0:w0 + len(proposes)]
    s1, t1, cpu1 = sink.stats(), time.monotonic(), time.process_time()
    watch.collect(t1)
    # (answers to the window's last updates, before the drafts are asked)
    loop.run_for(UNANSWERED_S, between)
    d1, td1 = drafts.report(f"{label}/1")
    heard = drafts.heard(f"{label}/1")
    trips = watch.measure(heard, until=t1 + UNANSWERED_S,
                          heard_complete=len(heard) < MAX_HEARD)
    loop.stop_all()
    watch.reset()
    closed = time.monotonic() + CLOSE_TIMEOUT_S
    while _registered(sink) > 0 and time.monotonic() < closed:
        time.sleep(0.05)
    gained, verify_steps = loop.gained - g0, loop.verify_steps - v0
    del loop
    baseline_steps += _baseline(rows, context, plan, gil_work, plan.baseline_s / 2)
    figures = cell_figures(
        rows, context, plan.k, propose_s=proposes, waits_s=waits, steps_s=steps,
        baseline_steps_s=baseline_steps, round_trips_s=trips["round_trips"],
        missed_round_trips=trips["unanswered"], sink_delta=minus(s1, s0), seconds=t1 - t0,
        drafts_delta=minus(d1, d0), drafts_seconds=td1 - td0, rss_mb=max(rss1 - rss0, 0.0),
        gained=gained, verify_steps=verify_steps, cpu_s=cpu1 - cpu0,
        legs=(trips["to_draft"], trips["from_draft"]))
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # the machine's, at the cell's end
    return figures


def _baseline(rows: int, context: int, plan: Plan, gil_work: int, seconds: float) -> list[float]:
    """Step times of the same loop without proposer and drafts."""
    base = EngineLoop(rows, context, plan, gil_work, rng_seed=plan.seed)
    base.start_all()
    base.activate_all()
    steps, _ = base.run_for(seconds)
    del base
    gc.collect()
    return steps


def run(plan: Plan, capacity: bool = True) -> dict:
    """Every cell of the plan (and the ingest-capacity cell first); the report."""
    t_start = time.monotonic()
    contexts = sorted({c for _, c in plan.cells})
    progress("building the proposer and its sink (the proposer imports vLLM)")
    proposer = build_proposer(plan, max(contexts))
    address = f"127.0.0.1:{proposer.sink.port}"
    watch = _Watch(proposer.sink)
    gil_work = calibrate_gil(plan.gil_ms / 1000.0)
    progress(f"sink on {address}; {plan.gil_ms:g} ms of GIL = {gil_work} loop iterations; "
             f"starting {plan.drafts} draft process(es)")
    drafts = DraftProcesses(plan.drafts, address, plan.draft)
    report: dict = {"ingest_capacity_tokens_per_s": None, "cells": []}
    try:
        deadline = time.monotonic() + 30.0
        while proposer.sink.stats()["streams"] < plan.drafts and time.monotonic() < deadline:
            time.sleep(0.05)
        if capacity:
            rows, context = plan.capacity_rows, contexts[0]
            fast = dataclasses.replace(plan.draft, rate=0.0, draft_step_ms=0.0,
                                       lookahead=max(SINK_MAX_PENDING, plan.k + 1))
            drafts.set_plan(fast)
            progress(f"capacity: rows {rows}, context {context}, drafts unthrottled")
            cap = run_cell(rows, context, dataclasses.replace(plan, draft=fast), proposer,
                           drafts, watch, gil_work, f"capacity {rows}x{context}")
            report["capacity"] = cap
            report["ingest_capacity_tokens_per_s"] = cap["ingest_tokens_per_s"]
            drafts.set_plan(plan.draft)
            progress(f"capacity: {cap['ingest_tokens_per_s']:,.0f} tokens/s into the book "
                     f"(offered {cap['offered_tokens_per_s']:,.0f})")
        for rows, context in plan.cells:
            label = f"{rows}x{context}"
            progress(f"cell {label}: baseline {plan.baseline_s:g} s, then drafts")
            cell = run_cell(rows, context, plan, proposer, drafts, watch, gil_work, label)
            report["cells"].append(cell)
            progress(f"cell {label}: propose p50 {cell['propose_p50_ms']} ms p99 "
                     f"{cell['propose_p99_ms']} ms, slowdown {cell['loop_slowdown']}, "
                     f"ingest {cell['ingest_tokens_per_s']:,.0f}/{cell['offered_tokens_per_s']:,.0f}"
                     f" tok/s, round trip p50 {cell['round_trip_p50_ms']} ms")
    finally:
        drafts.close()
        proposer.sink.stop()
    report["plan"] = dataclasses.asdict(plan)
    report["machine"] = {"cpus": os.cpu_count(), "load_average": list(os.getloadavg())}
    report["duration_s"] = round(time.monotonic() - t_start, 1)
    return report
