"""Faults and hostile drafts against a live target engine.

- Garbage on the wire (random ids, wrong positions, unknown requests, floods, and
  a hostile draft that answers every verified update with wrong tokens for the
  real requests' rows, with branches that the target takes and that continue
  with garbage, floods of branches past the bounds and at unknown positions,
  and the bounded wait on) changes no output token and crashes nothing.
- Killing the draft's engine processes mid-generation: requests complete, same output.
"""

import asyncio
import os
import queue
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import PROMPTS, SLOW_TARGET_ENV, Loop
from specserve.engine import EngineSettings
from specserve.local import LocalSpec, run_prompts, sampling_params
from specserve.wire import unpack_verified
from specserve.v1 import spec_pb2, spec_pb2_grpc

pytestmark = pytest.mark.slow

LONG = 160  # tokens per request in the kill test: long enough to kill mid-way


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


def slow_target_env():
    os.environ.update(SLOW_TARGET_ENV)


class HostileDraft(threading.Thread):
    """The draft the target chose, gone bad: it attaches to the real requests
    (it was given their tickets, `LocalSpec.tickets`) and, whenever the sink
    reports verified tokens, drafts random tokens with a branch that knows the
    target's true next token (it knows the reference output), continued with
    random tokens: the branch matches the rows after every rejection, and its
    garbage reaches the target's verifier at (almost) every step."""

    def __init__(self, address, spec, prompts_ids, answers, vocab, seed=0):
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(address)
        self.out: queue.Queue = queue.Queue()
        self.rng = np.random.default_rng(seed)
        self.spec = spec
        self.answers = {tuple(ids): list(ids) + list(a) for ids, a in zip(prompts_ids, answers)}
        self.vocab = vocab
        self.history: dict[str, list[int]] = {}
        self.answer_of: dict[str, list[int]] = {}
        self.verified_updates = 0
        self.errors = 0
        self.done = threading.Event()

    def send(self, **kind):
        self.out.put(spec_pb2.DraftMessage(**kind))

    def attach_new(self):
        """Take up the requests the target registered since the last look."""
        while not self.done.is_set():
            for rid, (ticket, prompt) in list(self.spec.tickets.items()):
                if rid not in self.history and tuple(prompt) in self.answers:
                    self.history[rid] = list(prompt)
                    self.answer_of[rid] = self.answers[tuple(prompt)]
                    self.send(open=spec_pb2.OpenRequest(request_id=rid, ticket=ticket))
                    self.garbage(rid)
            time.sleep(0.005)

    def run(self):
        threading.Thread(target=self.attach_new, daemon=True).start()
        call = spec_pb2_grpc.DraftSinkStub(self.channel).Connect(iter(self.out.get, None))
        try:
            for msg in call:
                if msg.WhichOneof("kind") == "verified":
                    for rid, position, tokens, _ in unpack_verified(msg.verified):
                        self.verified_updates += 1
                        self.history[rid][position:] = tokens
                        self.garbage(rid)
                else:
                    self.errors += 1
        except grpc.RpcError:
            pass

    def garbage(self, rid):
        """Wrong tokens from the verified position on, and a branch forking
        right there with the target's true next token, then garbage: the step
        that rejects the window takes the branch and verifies its garbage."""
        n = len(self.history[rid])
        answer = self.answer_of[rid]
        junk = self.rng.integers(0, self.vocab, 7).tolist()
        branches = []
        if n < len(answer) and junk[0] != answer[n]:
            branches.append(spec_pb2.Branch(
                fork_position=n, token_ids=[answer[n], *self.rng.integers(0, self.vocab, 6).tolist()]))
        for _ in range(40):  # past the per-request bound, at unknown positions, too long
            branches.append(spec_pb2.Branch(
                fork_position=int(self.rng.integers(0, n + 16)),
                token_ids=self.rng.integers(0, self.vocab, int(self.rng.integers(1, 40))).tolist()))
        self.send(draft=spec_pb2.DraftTokens(request_id=rid, position=n, token_ids=junk,
                                             branches=branches))

    def stop(self):
        self.done.set()
        self.out.put(None)
        self.channel.close()


def noise_streams(address, vocab, stop: threading.Event):
    """Clients of the draft port without tickets: guessed ids, drafts for
    unknown requests at any position, out-of-vocabulary ids, and a flood of
    opens. They reach nothing (NOT_FOUND each)."""
    rng = np.random.default_rng(1)
    channel = grpc.insecure_channel(address)
    stub = spec_pb2_grpc.DraftSinkStub(channel)
    codes = []

    def msgs():
        yield spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(request_id="n", ticket="guess"))
        while not stop.is_set():
            kind = int(rng.integers(0, 4))
            if kind == 0:
                yield spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
                    request_id=f"unknown-{rng.integers(1e6)}", position=3, token_ids=[1, 2]))
            elif kind == 1:
                yield spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
                    request_id="n", position=int(rng.integers(0, 1 << 40)),
                    token_ids=rng.integers(0, vocab, 8).tolist()))
            elif kind == 2:
                yield spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
                    request_id="n", position=1, token_ids=[vocab + 5, -3]))
            else:
                yield spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
                    request_id="n", position=1, token_ids=rng.integers(0, vocab, 4096).tolist()))
            time.sleep(0.001)

    def flood():  # opens of ids nobody registered
        for i in range(100000):
            if stop.is_set():
                return
            yield spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(request_id=f"f{i}"))

    def consume(gen):
        try:
            for _ in stub.Connect(gen):
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=consume, args=(g(),), daemon=True) for g in (msgs, flood)]
    for t in threads:
        t.start()
    return threads, codes, channel


def test_garbage_on_the_wire_changes_no_output(tiny_models, reference, loop):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
    slow_target_env()
    settings = EngineSettings(dtype="float32", kv_cache_gib=1)
    from specserve.config import SpeculationConfig

    spec = LocalSpec(str(tiny_models["target"]), None, k=4, lookahead=8, settings=settings,
                     sink_only=True, speculation=SpeculationConfig(max_wait_ms=50))
    try:
        loop.run(spec.__aenter__())
        vocab = 320
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        hostile = HostileDraft(spec.sink_address, spec, ids, reference, vocab)
        hostile.start()
        stop = threading.Event()
        threads, codes, channel = noise_streams(spec.sink_address, vocab, stop)
        time.sleep(0.5)
        outs = loop.run(run_prompts(spec, tok, PROMPTS, sampling_params(48, 0.0, True)))
        stop.set()
        hostile.stop()
        for t in threads:
            t.join(10)
        channel.close()
        for out, ref in zip(outs, reference):
            assert out.token_ids == ref
        # The garbage really was verified (and rejected) by the target ...
        assert spec.totals.draft_tokens > 50, spec.totals
        # (about one true token per step, then garbage)
        assert spec.totals.acceptance_rate < 0.5, spec.totals
        assert hostile.verified_updates > 0
        # ... branches were taken (and their garbage rejected), floods dropped ...
        book = loop.run(spec.sink_figures())["?"]
        assert book["branch_hits"] > 0 and book["branches_dropped"] > 0, book
        # ... the ticketless clients reached nothing (only the hostile draft's
        # requests were ever attached, and its per-request errors are few) ...
        assert hostile.errors < 50, hostile.errors
        # ... and the engine still serves.
        again = loop.run(run_prompts(spec, tok, PROMPTS[:1], sampling_params(48, 0.0, True)))
        assert again[0].token_ids == reference[0]
    finally:
        loop.run(spec.aclose())
        for var in SLOW_TARGET_ENV:
            os.environ.pop(var, None)


def test_killing_the_draft_mid_generation(tiny_models, loop):
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_reference

    target = str(tiny_models["target"])
    tok = AutoTokenizer.from_pretrained(target)
    reference = greedy_reference(target, PROMPTS, LONG)
    slow_target_env()
    settings = EngineSettings(dtype="float32", kv_cache_gib=1)
    spec = LocalSpec(target, target, k=4, lookahead=8, settings=settings)
    try:
        loop.run(spec.__aenter__())
        params = sampling_params(LONG, 0.0, True)
        fut = asyncio.run_coroutine_threadsafe(run_prompts(spec, tok, PROMPTS, params), loop.loop)
        # Kill the draft once it has demonstrably been feeding the target.
        deadline = time.monotonic() + 120
        while spec.totals.accepted_tokens < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert spec.totals.accepted_tokens >= 20, "the draft never fed the target"
        assert not fut.done(), "generation finished before the kill; raise LONG"
        # The draft's engine dies (a draft replica's process in Serve).
        for proc in spec.draft_worker.procs:
            os.kill(proc.pid, signal.SIGKILL)
        accepted_at_kill = spec.totals.accepted_tokens
        outs = fut.result(300)
        for out, ref in zip(outs, reference):
            assert out.token_ids == ref
        # New requests still run (target-only now), with the same output.
        again = loop.run(run_prompts(spec, tok, PROMPTS[:2], params))
        assert [o.token_ids for o in again] == reference[:2]
        assert not any(p.is_running() and p.status() != "zombie"
                       for p in spec.draft_worker.procs)
        assert spec.totals.accepted_tokens >= accepted_at_kill
    finally:
        loop.run(spec.aclose())
        for var in SLOW_TARGET_ENV:
            os.environ.pop(var, None)
