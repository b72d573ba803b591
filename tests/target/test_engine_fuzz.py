"""A fuzz of the speculating engine itself, below HTTP (issue 25).

Hypothesis draws batches of requests with every field vLLM's `SamplingParams`
takes (temperature 0 and > 0, top_k, top_p, min_p, penalties, n, logprobs,
prompt logprobs, stop strings and ids, min_tokens, bad words, allowed ids,
logit bias, structured outputs, seeds, max_tokens up to the context's edge),
greedy and sampled rows mixed, and sends each batch in staggered waves through
`DraftingEngine` (the engine client the target replica serves vLLM's OpenAI
app on) to a speculating engine, while a draft played here over the sink's
gRPC stream gives each sequence one behaviour: no draft, the target's true
continuation, the same late, garbage, or another request's continuation.
Swarm testing: each batch enables only some fields and some draft behaviours
(see `batch`). The deterministic rows run on a target-only engine too.

What must hold, for every batch:
- the engine stays alive and every request ends with a result or a clear
  refusal (vLLM's VLLMClientError or a ValueError, which vLLM's OpenAI layer
  answers with a 4xx), and a refusal only for what is refused on purpose
  (min_p at temperature > 0 and logit_bias while speculating, vLLM's own
  rule; a seed at temperature > 0 on the CPU engine, `DraftingEngine`'s);
- deterministic rows (temperature 0, or top_k = 1) equal the target-only
  engine's output token for token, whatever the drafts were.
Sampled rows' distributions are tests/target/test_sampling.py's business.

CI runs SPECSERVE_ENGINE_FUZZ_BATCHES (default 43) batches of 48 requests
(2 064 in all); set it higher for the long form (docs/reliability.md).
The module's second test checks the totals, so run the module whole.
"""

import asyncio
import contextvars
import heapq
import itertools
import os
import queue
import random
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import Loop
from specserve.testing.tiny import N_TOKENIZER
from specserve.v1 import spec_pb2, spec_pb2_grpc
from specserve.wire import unpack_verified

pytestmark = pytest.mark.slow

BATCHES = int(os.environ.get("SPECSERVE_ENGINE_FUZZ_BATCHES", "43"))
PER_BATCH = 48  # requests, in waves of WAVES sizes: 2 064 in CI's short form
WAVES = (1, 3, 8, 16, 48)
STAGGER_S = 0.15  # between the starts of a batch's waves
K = 4
MAX_MODEL_LEN = 128
VOCAB = 320  # the tiny model's (specserve/testing/tiny.py MODEL_VOCAB)
MODES = ("none", "true", "late", "garbage", "foreign")
GRAMMARS = ({"choice": ["yes", "no", "maybe"]}, {"regex": "[a-e]{3,9}"})


class DraftPlayer(threading.Thread):
    """The draft side of the sink's stream, played by the test: per sequence one
    of MODES, re-drafted at every `Verified` the sink sends back.

    `true` drafts the target's greedy continuation while the row follows it and
    repeats the last token once it has left it (a sampled row); `late` is
    `true` sent 5-150 ms after it was due; `garbage` is random ids (some out of
    the vocabulary, some at wrong positions); `foreign` is another prompt's
    continuation."""

    def __init__(self, address: str, seed: int = 0):
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(address)
        self.out: queue.Queue = queue.Queue()
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()
        self.plan: dict[str, tuple[str, list[int], list[int]]] = {}  # base id -> (mode, ref, foreign)
        self.history: dict[str, list[int]] = {}
        self.mode: dict[str, str] = {}
        self.late: list = []  # heap of (due, n, message)
        self.wake = threading.Condition()
        self.counter = itertools.count()
        self.verified = self.errors = 0
        self.stopped = False
        threading.Thread(target=self._late_sender, daemon=True).start()

    def plan_request(self, request_id: str, mode: str, reference: list[int],
                     foreign: list[int]) -> None:
        with self.lock:
            self.plan[request_id] = (mode, reference, foreign)

    def base(self, rid: str) -> str:
        """The engine request of a sequence id (vLLM names n > 1 sequences "{i}_{id}")."""
        return rid if rid in self.plan else rid.split("_", 1)[1]

    def __call__(self, pool, rid, prompt_ids, max_tokens, k, ticket):
        """DraftingEngine's open_draft: opens the registered sequence on the stream."""
        mode, _, _ = self.plan[self.base(rid)]
        with self.lock:
            self.history[rid] = list(prompt_ids)
            self.mode[rid] = mode
        self.send(open=spec_pb2.OpenRequest(request_id=rid, ticket=ticket))
        self.draft(rid)
        player = self

        class Stream:
            who = {"model": "fuzz", "replica": "fuzz-0", "lag": 0.0, "k": k}

            def close(self):
                player.send(close=spec_pb2.CloseRequest(request_id=rid))
                with player.lock:
                    player.history.pop(rid, None)

        return Stream()

    def send(self, **kind) -> None:
        self.out.put(spec_pb2.DraftMessage(**kind))

    def draft(self, rid: str) -> None:
        with self.lock:
            hist = self.history.get(rid)
            if hist is None:
                return
            hist = list(hist)
            mode, ref, foreign = self.plan[self.base(rid)]
        n = len(hist)
        if mode in ("true", "late"):
            tokens = ref[n:n + 8] if ref[:n] == hist else [hist[-1]] * 3
        elif mode == "foreign":
            tokens = foreign[n:n + 8] or foreign[-8:]
        else:
            tokens = self.rng.integers(-2, VOCAB + 3, int(self.rng.integers(1, 9))).tolist()
            n += int(self.rng.choice([0, 0, 0, 1, -1, 5]))
        if not tokens or n < 0:
            return
        msg = spec_pb2.DraftMessage(draft=spec_pb2.DraftTokens(
            request_id=rid, position=n, token_ids=[int(t) for t in tokens]))
        if mode == "late":
            with self.wake:
                heapq.heappush(self.late, (time.monotonic() + self.rng.uniform(0.005, 0.15),
                                           next(self.counter), msg))
                self.wake.notify()
        else:
            self.out.put(msg)

    def _late_sender(self) -> None:
        with self.wake:
            while not self.stopped:
                now = time.monotonic()
                while self.late and self.late[0][0] <= now:
                    self.out.put(heapq.heappop(self.late)[2])
                self.wake.wait(self.late[0][0] - now if self.late else 0.5)

    def run(self) -> None:
        call = spec_pb2_grpc.DraftSinkStub(self.channel).Connect(iter(self.out.get, None))
        try:
            for msg in call:
                if msg.WhichOneof("kind") == "verified":
                    for rid, position, tokens, _ in unpack_verified(msg.verified):
                        self.verified += 1
                        with self.lock:
                            hist = self.history.get(rid)
                            if hist is not None:
                                hist[position:] = tokens
                        self.draft(rid)
                elif msg.WhichOneof("kind") == "error":
                    self.errors += 1  # garbage answered per request, as it should be
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.out.put(None)
        self.channel.close()


@pytest.fixture(scope="module")
def engines(tiny_models):
    """(speculating LocalSpec with the test's draft player, target-only LocalSpec, loop)."""
    from specserve.local import LocalSpec
    from specserve.engine import EngineSettings

    target = str(tiny_models["target"])
    settings_ = EngineSettings(dtype="float32", kv_cache_gib=1, seed=3, max_model_len=MAX_MODEL_LEN)
    loop = Loop()
    spec = LocalSpec(target, None, k=K, settings=settings_, sink_only=True)
    alone = LocalSpec(target, None, settings=settings_)
    player = None
    try:
        loop.run(spec.__aenter__())
        loop.run(alone.__aenter__())
        player = DraftPlayer(spec.sink_address)
        player.start()
        yield spec, alone, player, loop
    finally:
        if player is not None:
            player.stop()
        loop.run(spec.aclose())
        loop.run(alone.aclose())
        loop.close()


# ---- the requests -------------------------------------------------------------------

token = st.integers(3, N_TOKENIZER - 1)  # byte tokens: every id detokenizes
# How often each optional field is in a request: so that a batch of 50 mixes
# most of them, and the ones refused on purpose stay a small share.
OFTEN = {"min_p": 0.05, "logit_bias": 0.03, "seed": 0.05}


@st.composite
def request(draw, prompts, enabled, modes):
    """One request of a batch that may use the fields in `enabled` and the
    draft behaviours in `modes`."""
    # Which fields a request has comes from `rng`, seeded by hypothesis (so a
    # failing batch replays): hypothesis's own integers lean to their bounds,
    # which would put nearly every field into nearly every request, and its
    # randoms() would overflow its buffer at 50 requests a batch.
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    prompt = draw(st.sampled_from(prompts))
    room = MAX_MODEL_LEN - len(prompt)
    # Now and then up to the context's edge (the proposer must not draft past it).
    max_tokens = room if rng.random() < 0.03 else draw(st.integers(1, 24))
    t = 0.0 if rng.random() < 0.5 else draw(st.floats(0.05, 2.0))
    fields = dict(
        max_tokens=max_tokens,
        temperature=t,
        n=draw(st.sampled_from([1, 1, 1, 2, 3])) if t > 0 else 1,  # vLLM: n = 1 when greedy
        ignore_eos=draw(st.booleans()),
    )
    optional = {
        "top_k": st.sampled_from([-1, 0, 1, 1, 2, 5, 40, VOCAB, VOCAB + 7]),
        "top_p": st.floats(0.05, 1.0),
        "min_p": st.floats(0.01, 1.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.floats(0.5, 2.0),
        "logprobs": st.integers(0, 5),
        "prompt_logprobs": st.integers(0, 3),
        "stop": st.lists(st.text("abcdeht ", min_size=1, max_size=3), min_size=1, max_size=3),
        "stop_token_ids": st.lists(token, min_size=1, max_size=3),
        "include_stop_str_in_output": st.booleans(),
        "min_tokens": st.integers(0, max_tokens),
        # (a bad word must be a token of its own: " " alone is refused)
        "bad_words": st.lists(st.text("abcdeht", min_size=1, max_size=2), min_size=1, max_size=2),
        "allowed_token_ids": st.lists(token, min_size=1, max_size=40, unique=True),
        "logit_bias": st.dictionaries(token, st.floats(-100, 100), min_size=1, max_size=3),
        "seed": st.integers(0, 2**31 - 1),
        "skip_special_tokens": st.booleans(),
        "structured_outputs": st.sampled_from(GRAMMARS),
    }
    for name, strategy in optional.items():
        if name in enabled and rng.random() < OFTEN.get(name, 0.3):
            fields[name] = draw(strategy)
    return prompt, fields, draw(st.sampled_from(modes)), draw(st.integers(1, K))


FIELDS = ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logprobs", "prompt_logprobs", "stop", "stop_token_ids",
          "include_stop_str_in_output", "min_tokens", "bad_words", "allowed_token_ids",
          "logit_bias", "seed", "skip_special_tokens", "structured_outputs")


@st.composite
def batch(draw):
    """(requests, wave sizes): PER_BATCH requests sent in staggered waves, the
    requests of a wave at once. Swarm testing: each batch enables only some fields and
    some draft behaviours, and waves vary in size, because what one row does
    can hide another's crash: vLLM's top_k crash (vllm_fixes 2) needs a step
    with top_k rows, no top_p row and no drafted token, which a big batch using
    every field at once almost never has."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    enabled = {f for f in FIELDS if rng.random() < 0.5}
    modes = [m for m in MODES if rng.random() < 0.5] or ["none"]
    waves = []
    while sum(waves) < PER_BATCH:
        waves.append(min(draw(st.sampled_from(WAVES)), PER_BATCH - sum(waves)))
    prompts = draw(st.lists(st.lists(token, min_size=1, max_size=40), min_size=1, max_size=12))
    items = draw(st.lists(request(prompts, enabled, modes), min_size=PER_BATCH,
                          max_size=PER_BATCH))
    return items, waves


def params_of(fields: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    f = dict(fields)
    if "structured_outputs" in f:
        f["structured_outputs"] = StructuredOutputsParams(**f["structured_outputs"])
    return SamplingParams(**f)


def refused_on_purpose(fields: dict) -> bool:
    sampled = fields["temperature"] > 0  # at 0 vLLM drops min_p (greedy)
    return (bool(fields.get("logit_bias")) or (sampled and fields.get("min_p", 0) > 0)
            or (sampled and fields.get("seed") is not None))


def deterministic(fields: dict) -> bool:
    return fields["temperature"] == 0 or fields.get("top_k") == 1


# ---- running a batch ------------------------------------------------------------------


async def run_one(client, prompt, fields, rid, route):
    """(outputs, None) or (None, refusal) for one request through `client`."""
    from vllm.exceptions import VLLMClientError
    from vllm.inputs import TokensPrompt

    from specserve.target.drafting import ROUTE

    ROUTE.set(route)  # this task's own context: the route of this request only
    try:
        latest = {}  # sequence index -> its last (cumulative) output
        async for out in client.generate(TokensPrompt(prompt_token_ids=prompt),
                                         params_of(fields), rid):
            latest.update((o.index, o) for o in out.outputs)
        return [(list(o.token_ids), o.finish_reason, o.logprobs)
                for _, o in sorted(latest.items())], None
    except (VLLMClientError, ValueError) as e:  # the OpenAI layer answers these with a 4xx
        assert str(e), "a refusal must say why"
        return None, e


async def run_batch(client, items, ids, routes):
    """Every request of `items` at once, each in its own task and context."""
    tasks = [asyncio.get_running_loop().create_task(
        run_one(client, prompt, fields, rid, route), context=contextvars.Context())
        for (prompt, fields, _, _), rid, route in zip(items, ids, routes)]
    return await asyncio.gather(*tasks)


async def run_waves(client, items, ids, routes, waves):
    """Wave j of the batch starts STAGGER_S * j after the first, whether or not
    the earlier ones have finished: the engine's batch keeps changing."""
    async def wave(j, first, size):
        await asyncio.sleep(STAGGER_S * j)
        part = slice(first, first + size)
        return await run_batch(client, items[part], ids[part], routes[part])

    starts = [sum(waves[:j]) for j in range(len(waves))]
    done = await asyncio.gather(*(wave(j, first, size)
                                  for j, (first, size) in enumerate(zip(starts, waves))))
    return [r for part in done for r in part]


counts = {"requests": 0, "refused": 0, "deterministic": 0, "sampled": 0}
batch_ids = itertools.count()
timing = {"speculating": 0.0}


@settings(max_examples=BATCHES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate],  # shrinking a dead engine helps nobody
          suppress_health_check=list(HealthCheck))
@given(drawn=batch())
def test_no_request_mix_kills_the_engine_or_changes_a_deterministic_row(engines, drawn):
    from specserve.target.drafting import DraftingEngine, Route

    spec, alone, player, loop = engines
    items, waves = drawn
    b = next(batch_ids)
    # The target's greedy continuation of each prompt, for `true` drafts.
    prompts = list(dict.fromkeys(tuple(p) for p, _, _, _ in items))
    plain = params_of({"max_tokens": 32, "temperature": 0.0, "ignore_eos": True})

    async def continuations():
        return await asyncio.gather(*(alone.generate(list(p), plain) for p in prompts))

    greedy = dict(zip(prompts, loop.run(continuations())))
    ids = [f"b{b}-{i}" for i in range(len(items))]
    for rid, (prompt, fields, mode, k) in zip(ids, items):
        other = prompts[(prompts.index(tuple(prompt)) + 1) % len(prompts)]
        player.plan_request(rid, mode, list(prompt) + greedy[tuple(prompt)],
                            list(other) + greedy[other])
    routes = [Route(draft=None if mode == "none" else "fuzz", k=k) for _, _, mode, k in items]
    speculating = DraftingEngine(spec.engine, player, k_max=K, target_replica="fuzz",
                                 on_cpu=True)
    reference = DraftingEngine(alone.engine, player, k_max=0, target_replica="alone",
                               on_cpu=True)
    started = time.monotonic()
    got = loop.run(run_waves(speculating, items, ids, routes, waves), timeout=300)
    timing["speculating"] += time.monotonic() - started
    assert not spec.engine.errored, "the speculating engine died"
    # The target alone runs the rows whose output is determined (the others
    # would only cost time); refused rows get a stand-in.
    checked = [i for i, (_, f, _, _) in enumerate(items)
               if deterministic(f) and not refused_on_purpose(f)]
    ran = loop.run(run_batch(reference, [items[i] for i in checked],
                             [f"r{b}-{i}" for i in checked], [Route() for _ in checked]),
                   timeout=300)
    want = [(None, None)] * len(items)
    for i, r in zip(checked, ran):
        want[i] = r

    for (prompt, fields, mode, k), (outs, refusal), (ref, ref_refusal) in zip(items, got, want):
        counts["requests"] += 1
        if refused_on_purpose(fields):
            assert refusal is not None, f"{fields} should have been refused"
            counts["refused"] += 1
            continue
        assert refusal is None, f"{fields} (draft {mode}) refused: {refusal}"
        assert ref_refusal is None, f"target-only refused {fields}: {ref_refusal}"
        assert len(outs) == fields["n"]
        for tokens, finish, logprobs in outs:
            assert finish is not None and len(tokens) <= fields["max_tokens"]
            if fields.get("logprobs") is not None:
                assert logprobs is not None and len(logprobs) == len(tokens)
        if deterministic(fields):
            counts["deterministic"] += 1
            assert [(t, f) for t, f, _ in outs] == [(t, f) for t, f, _ in ref], (
                f"{fields} (draft {mode}, K {k}) differs from the target alone")
        else:
            counts["sampled"] += 1



def test_the_fuzz_ran_and_the_engine_still_answers(engines, reference):
    """After the fuzz (this module's first test): enough requests of every kind
    went through, the drafts really were verified, and a plain greedy request
    still gives transformers' target-only output."""
    from transformers import AutoTokenizer

    from conftest import MAX_TOKENS, PROMPTS
    from specserve.local import run_prompts, sampling_params

    spec, alone, player, loop = engines
    print(f"\nengine fuzz: {counts}, {timing['speculating']:.0f} s speculating, "
          f"{spec.totals.draft_tokens} drafted, "
          f"{spec.totals.accepted_tokens} accepted, {player.errors} draft errors")
    assert counts["requests"] == BATCHES * PER_BATCH, counts
    assert counts["deterministic"] > 0.2 * counts["requests"], counts
    assert counts["sampled"] > 0.2 * counts["requests"], counts
    assert counts["refused"] > 0, counts
    # (1 256 and 1 300 accepted of 2 064 requests in two runs here)
    assert spec.totals.accepted_tokens > counts["requests"] // 8, spec.totals
    assert spec.totals.draft_tokens > spec.totals.accepted_tokens, spec.totals
    assert player.verified > 0
    tok = AutoTokenizer.from_pretrained(str(spec.target))
    outs = loop.run(run_prompts(spec, tok, PROMPTS, sampling_params(MAX_TOKENS, 0.0, True)))
    assert [o.token_ids for o in outs] == reference
