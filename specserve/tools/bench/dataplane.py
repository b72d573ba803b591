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

import contextlib
import ctypes
import dataclasses
import gc
import os
import secrets
import sys
import time
import types

from specserve.tools.bench.dataplane_draft import DraftProcesses
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
                       max_stream_messages_per_s=MAX_STREAM_MESSAGES_PER_S).to_env()
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
    built on it (its window starts at or past the update's end) applied to the book.

    Wraps the sink's book's `propose_rows` (to see the verified batches it hands
    out, and when) and `extend_batch` (to see, per request, when a window built
    on a newer verified position first arrives). Both wrappers cost a clock read
    and a dict update per request, in the same threads as the calls they wrap."""

    def __init__(self, sink):
        book = sink._book
        self._propose, self._extend = book.propose_rows, book.extend_batch
        book.propose_rows, book.extend_batch = self._on_propose, self._on_extend
        self.handed: list = []  # (updates, when), drained by collect()
        self.newest: dict = {}  # key -> (position, when) of the first message built on it
        self.waiting: dict = {}  # key -> [(end, when sent)], oldest first
        self.round_trips: list[float] = []
        self.answered: list[tuple] = []  # (request id, end, sent, answer in the book)
        self.handed_out: list[tuple] = []  # (request id, end, sent): every update, answered or not
        self.unanswered = 0

    def _on_propose(self, *args, **kwargs):
        proposals, verified = self._propose(*args, **kwargs)
        if len(verified):
            self.handed.append((verified, time.monotonic()))
        return proposals, verified

    def _on_extend(self, stream, keys, positions, *args, **kwargs):
        now = time.monotonic()
        for key, position in zip(keys, list(positions)):
            last = self.newest.get(key)
            if last is None or position > last[0]:
                self.newest[key] = (position, now)
        return self._extend(stream, keys, positions, *args, **kwargs)

    def collect(self, now: float) -> None:
        """Match the updates handed out with answers seen (called between steps)."""
        handed, self.handed = self.handed, []
        for verified, when in handed:
            for key, end in zip(verified.keys, (verified.positions + verified.counts).tolist()):
                self.waiting.setdefault(key, []).append((end, when))
                if len(self.handed_out) < MAX_HANDED:
                    self.handed_out.append((key, end, when))
        for key in list(self.waiting):
            pending = self.waiting[key]
            seen = self.newest.get(key)
            while pending and seen is not None and seen[0] >= pending[0][0] \
                    and seen[1] >= pending[0][1]:
                end, sent = pending.pop(0)
                self.round_trips.append(seen[1] - sent)
                self.answered.append((key, end, sent, seen[1]))
            while pending and now - pending[0][1] > UNANSWERED_S:
                pending.pop(0)
                self.unanswered += 1
            if not pending:
                del self.waiting[key]
        if len(self.newest) > 65536:  # closed requests' entries
            self.newest = {k: v for k, v in self.newest.items() if k in self.waiting}

    def reset(self) -> None:
        self.round_trips, self.unanswered, self.answered, self.handed_out = [], 0, [], []

    def legs(self, heard: dict) -> tuple[list[float], list[float]]:
        """The round trip's legs where the draft noted an update's arrival: sink ->
        draft for every update it got (answered or not: an overrun draft is late
        here), draft -> book for the answered ones."""
        out = [heard[(rid, end)] - sent for rid, end, sent in self.handed_out
               if heard.get((rid, end), -1.0) >= sent]
        back = []
        for rid, end, sent, answer in self.answered:
            got = heard.get((rid, end))
            if got is not None and sent <= got <= answer:
                back.append(answer - got)
        return out, back

    def forget(self) -> None:
        """Between cells: nothing outstanding carries over."""
        self.collect(time.monotonic())
        self.waiting, self.newest = {}, {}


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
    watch.collect(t0)
    watch.reset()
    g0, v0 = loop.gained, loop.verify_steps
    steps, proposes = loop.run_for(plan.duration_s, between)
    s1, t1, cpu1 = sink.stats(), time.monotonic(), time.process_time()
    watch.collect(t1)
    d1, td1 = drafts.report(f"{label}/1")
    to_draft, from_draft = watch.legs(drafts.heard(f"{label}/1"))
    loop.stop_all()
    watch.forget()
    closed = time.monotonic() + CLOSE_TIMEOUT_S
    while _registered(sink) > 0 and time.monotonic() < closed:
        time.sleep(0.05)
    gained, verify_steps = loop.gained - g0, loop.verify_steps - v0
    del loop
    baseline_steps += _baseline(rows, context, plan, gil_work, plan.baseline_s / 2)
    figures = cell_figures(
        rows, context, plan.k, propose_s=proposes, steps_s=steps,
        baseline_steps_s=baseline_steps, round_trips_s=watch.round_trips,
        missed_round_trips=watch.unanswered, sink_delta=minus(s1, s0), seconds=t1 - t0,
        drafts_delta=minus(d1, d0), drafts_seconds=td1 - td0, rss_mb=max(rss1 - rss0, 0.0),
        gained=gained, verify_steps=verify_steps, cpu_s=cpu1 - cpu0,
        legs=(to_draft, from_draft))
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
