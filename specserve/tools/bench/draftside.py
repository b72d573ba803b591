"""`specserve bench draftside`: one draft replica serving many concurrent requests.

Owns the measurement of the draft side at scale (the data-plane issue's item
6): how close a draft replica's DraftRunner runs to its engine's own token
rate, its per-token Python work, and its messages per second, with N
concurrent requests (default 256) on one draft engine.

Two phases on the same vLLM engine (the draft model; prefix caching off, so
neither phase reuses the other's prompts), each with N requests of random
prompt ids, each drafting T tokens greedily:

- engine: the requests straight to the engine (AsyncLLM, streamed one step at
  a time, as VllmDraftModel asks): its own token rate;
- runner: the same requests through the real draft side: the DraftRunner
  (specserve/draft/runner.py) with VllmDraftModel (specserve/draft/model.py),
  its SinkLink (deltas, one DraftBatch per event-loop turn, protobuf, gRPC) to
  a sink in another process that verifies every drafted token at once (an
  infinitely fast target that accepts everything: the heaviest load a draft
  side can get).

A third phase runs the runner and link with a model that costs nothing (one
token per request per event-loop turn): the draft side's own ceiling, in
tokens/s, with the draft process's CPU all its own.

Reported: tokens/s of each phase and their ratio; the draft process's CPU
seconds per token (time.process_time: the engine frontend, the runner, the
link and gRPC's threads; the engine core is another process) in each, and
their difference, the runner's per-token Python work; DraftBatch messages
and wire tokens per second. Never runs in the test suite (minutes); a short
form of its pure parts does (tests/tools/test_bench_draftside.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import random
import sys
import time

from specserve.tools.bench.stats import fmt, markdown_table


@dataclasses.dataclass(frozen=True)
class DraftSideArgs:
    draft: str  # model folder
    requests: int = 256
    prompt_tokens: int = 128
    max_tokens: int = 64
    k: int = 4
    lookahead: int = 9  # 2K + 1
    seed: int = 0
    dtype: str = "float32"
    kv_cache_gib: int = 2


def phase_figures(tokens: int, wall_s: float, cpu_s: float) -> dict:
    """tokens/s and CPU microseconds per token of one phase."""
    return {"tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "cpu_s": round(cpu_s, 3),
            "cpu_us_per_token": 1e6 * cpu_s / tokens if tokens else 0.0}


def compare(engine: dict, runner: dict, batches: int, wire_tokens: int) -> dict:
    """The runner against the engine alone: its share of the engine's token
    rate, its Python work per token (the CPU difference), its messages."""
    wall = runner["wall_s"]
    return {"rate_vs_engine": runner["tokens_per_s"] / engine["tokens_per_s"]
            if engine["tokens_per_s"] else 0.0,
            "python_us_per_token": runner["cpu_us_per_token"] - engine["cpu_us_per_token"],
            "batches_per_s": batches / wall if wall else 0.0,
            "wire_tokens_per_s": wire_tokens / wall if wall else 0.0,
            "tokens_per_batch": runner["tokens"] / batches if batches else 0.0}


class InstantModel:
    """A draft model that costs nothing: one token (7) per request per turn of
    the event loop, as an engine step that took no time would give. Through the
    runner it measures the draft side's own ceiling."""

    max_model_len = 1 << 30

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        for _ in range(max_tokens):
            await asyncio.sleep(0)
            yield [7]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


# ---- the sink that accepts everything (its own process) -------------------------------


def _serve_echo(port_out) -> None:
    from concurrent import futures

    import grpc

    from specserve.v1 import spec_pb2, spec_pb2_grpc
    from specserve.wire import CHANNEL_OPTIONS

    class EchoSink(spec_pb2_grpc.DraftSinkServicer):
        """Verifies every drafted token as soon as it arrives."""

        def Connect(self, request_iterator, context):
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "batch":
                    continue
                b = msg.batch
                held = [p + c for p, c in zip(b.positions, b.counts)]
                yield spec_pb2.SinkMessage(verified=spec_pb2.VerifiedBatch(
                    request_ids=b.request_ids, positions=b.positions, counts=b.counts,
                    token_ids=b.token_ids, held=held))

    server = grpc.server(futures.ThreadPoolExecutor(4), options=CHANNEL_OPTIONS)
    spec_pb2_grpc.add_DraftSinkServicer_to_server(EchoSink(), server)
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


# ---- the two phases --------------------------------------------------------------------


async def _engine_phase(engine, ids: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False, output_kind=RequestOutputKind.DELTA)

    async def one(i, prompt):
        n = 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                         f"engine-{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    cpu, start = time.process_time(), time.monotonic()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(ids)))
    return phase_figures(sum(counts), time.monotonic() - start, time.process_time() - cpu)


async def runner_phase(model, ids: list[list[int]], a: DraftSideArgs, address: str):
    """The requests through a DraftRunner over `model` and its SinkLink to the
    sink at `address`, until every drafted token is verified:
    (phase figures, DraftBatch messages, wire tokens)."""
    from specserve.draft.runner import DraftRunner

    runner = DraftRunner(model, name="bench/draftside")
    want = len(ids) * a.max_tokens
    cpu, start = time.process_time(), time.monotonic()
    for i, prompt in enumerate(ids):
        runner.start(f"runner-{i}", prompt, address, a.lookahead, a.max_tokens, a.k)
    while runner.stats.verified_tokens < want:
        await asyncio.sleep(0.01)
    wall, cpu_s = time.monotonic() - start, time.process_time() - cpu
    [link] = runner.links()
    batches, wire_tokens = link.batches, link.tokens_sent
    await runner.close()
    return phase_figures(runner.stats.verified_tokens, wall, cpu_s), batches, wire_tokens


def start_echo_sink():
    """The sink that accepts everything, in its own process: (process, address)."""
    ctx = multiprocessing.get_context("spawn")
    port_q = ctx.Queue()
    sink = ctx.Process(target=_serve_echo, args=(port_q,), daemon=True)
    sink.start()
    return sink, f"127.0.0.1:{port_q.get(timeout=60)}"


async def run(a: DraftSideArgs, progress=lambda m: None) -> dict:
    from specserve.draft.model import VllmDraftModel
    from specserve.draft.worker import DraftWorker
    from specserve.engine import EngineSettings, shutdown_engine

    sink, address = start_echo_sink()
    settings = EngineSettings(max_model_len=a.prompt_tokens + a.max_tokens + a.lookahead + 8,
                              max_num_seqs=a.requests, seed=a.seed, dtype=a.dtype,
                              kv_cache_gib=a.kv_cache_gib, enable_prefix_caching=False)
    progress(f"starting the draft engine ({a.draft}), max_num_seqs {a.requests}")
    engine, procs = DraftWorker.start_model_engine(a.draft, settings, None)
    try:
        vocab = engine.model_config.get_vocab_size()
        await _engine_phase(engine, prompts(4, 16, vocab, a.seed + 99), 8)  # warm-up
        progress(f"engine alone: {a.requests} requests x {a.max_tokens} tokens")
        engine_fig = await _engine_phase(
            engine, prompts(a.requests, a.prompt_tokens, vocab, a.seed), a.max_tokens)
        progress(f"through the runner and the link: {a.requests} requests")
        runner_fig, batches, wire_tokens = await runner_phase(
            VllmDraftModel(engine, engine.model_config.max_model_len),
            prompts(a.requests, a.prompt_tokens, vocab, a.seed + 1), a, address)
        shutdown_engine(engine, procs)
        engine = None
        progress(f"the runner's ceiling (a model that costs nothing): {a.requests} requests")
        ceiling_fig, c_batches, _ = await runner_phase(
            InstantModel(), prompts(a.requests, a.prompt_tokens, vocab, a.seed + 2), a, address)
    finally:
        if engine is not None:
            shutdown_engine(engine, procs)
        sink.kill()
    ceiling_fig["batches_per_s"] = c_batches / ceiling_fig["wall_s"]
    return {"args": dataclasses.asdict(a), "engine": engine_fig, "runner": runner_fig,
            "ceiling": ceiling_fig, **compare(engine_fig, runner_fig, batches, wire_tokens)}


def table(result: dict) -> str:
    e, r = result["engine"], result["runner"]
    rows = [{"phase": "engine alone", "rate": e["tokens_per_s"], "x": 1.0,
             "cpu": e["cpu_us_per_token"]},
            {"phase": "runner + link", "rate": r["tokens_per_s"], "x": result["rate_vs_engine"],
             "cpu": r["cpu_us_per_token"], "batches": result["batches_per_s"],
             "per_batch": result["tokens_per_batch"]}]
    c = result.get("ceiling")
    if c:
        rows.append({"phase": "runner + link, no engine (ceiling)", "rate": c["tokens_per_s"],
                     "x": c["tokens_per_s"] / e["tokens_per_s"] if e["tokens_per_s"] else None,
                     "cpu": c["cpu_us_per_token"], "batches": c["batches_per_s"],
                     "per_batch": c["tokens"] / (c["batches_per_s"] * c["wall_s"])
                     if c["batches_per_s"] else None})
    return markdown_table(rows, [("phase", "phase"), ("rate", "tokens/s"), ("x", "x engine"),
                                 ("cpu", "draft-process CPU µs/token"),
                                 ("batches", "DraftBatch/s"), ("per_batch", "tokens/batch")])


def add_arguments(p, positive_int) -> None:
    p.add_argument("--draft", help="draft model folder (default: the shipped draft of the "
                   "default model)")
    p.add_argument("--requests", type=positive_int("requests"), default=256,
                   help="concurrent requests on the one draft engine (default 256)")
    p.add_argument("--prompt-tokens", type=positive_int("prompt-tokens"), default=128)
    p.add_argument("--max-tokens", type=positive_int("max-tokens"), default=64,
                   help="tokens each request drafts (default 64)")
    p.add_argument("--num-speculative-tokens", type=positive_int("num-speculative-tokens"),
                   default=4, help="K (default 4; the lookahead is 2K + 1)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--json", dest="json_path", help="write the result as JSON to this file")


def main(args, draft: str) -> int:
    k = args.num_speculative_tokens
    a = DraftSideArgs(draft=draft, requests=args.requests, prompt_tokens=args.prompt_tokens,
                      max_tokens=args.max_tokens, k=k, lookahead=2 * k + 1, dtype=args.dtype)
    result = asyncio.run(run(a, lambda m: print(f"[draftside] {m}", file=sys.stderr,
                                                flush=True)))
    print(table(result))
    print(f"\nthe runner's Python work: {result['python_us_per_token']:.1f} µs per token "
          "(draft-process CPU, runner minus engine alone)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0
