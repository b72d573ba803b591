"""Measuring the real system for the simulator: step-cost profiles and throughput cells.

Owns the measurement harness that `python -m specserve.tools.gpucheck` runs
(its presets: `make gpu-check` on a GPU, `--preset tiny` in the tests,
`--preset calibrate` for the simulator's calibration, docs/calibration.md):

- `run_cell`: one (system, concurrency) measurement on a running `LocalSpec`:
  n prompts through the engine with at most C in flight; output tokens per
  second, per-request latency per token, and vLLM's own spec-decode counters
  (acceptance, coverage).
- `measure_profile`: a `specserve-profile/1` (specserve/tools/simulate/profile.py) for a
  target on this hardware. Step time is the difference of two runs that differ
  only in output length (so start-up, prefill and the last step cancel):
  target-only at several batch sizes gives step_ms(tokens = batch); the
  speculative engine with a synthetic draft at A = 1 (every drafted token right)
  gives step_ms at tokens = batch * (1 + drafts per step), overhead included;
  A = 0 (no drafts ever waiting after the first rejection) gives the proposer's
  fixed overhead per step.
- Random-weight models of given shapes (`write_model`): a config and a
  tokenizer only; the engine builds the weights itself (vLLM load_format
  "dummy"), so an 8B-shaped target needs no 16 GB file.

Prompts are random token ids (seeded): content does not change step costs, and
the synthetic draft replays whatever the target says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from pathlib import Path

from specserve.acceptance.record import Figures, percentile

log = logging.getLogger(__name__)


# ---- random-weight models ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0


SHAPES = {
    # Llama-3-8B and Llama-3.2-1B shapes (their published config.json values).
    "llama3-8b": Shape("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128),
    "llama3.2-1b": Shape("llama3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, True),
    # CPU-sized stand-ins with the same code path.
    "tiny": Shape("tiny", 512, 128, 256, 2, 2, 2, 64, max_position_embeddings=1024),
    "tiny-draft": Shape("tiny-draft", 512, 128, 256, 1, 2, 2, 64, max_position_embeddings=1024),
}


def write_model(path: Path | str, shape: Shape, dtype: str = "bfloat16") -> Path:
    """A Llama config of this shape and a word-level tokenizer covering its whole
    vocabulary ("t3", "t4", ...), so any id the random model emits decodes.
    Load it with vLLM load_format="dummy" (random weights made on the device)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
        bos_token_id=1, eos_token_id=2, torch_dtype=dtype,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(path))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, shape.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))
    return path


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


# ---- one measurement ------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    system: str                  # target_only | specserve_synthetic
    concurrency: int
    k: int
    alpha: float | None
    prompts: int
    max_tokens: int
    output_tokens: int
    wall_s: float
    draft_tokens: int
    accepted_tokens: int
    steps_with_drafts: int
    latency_per_token_ms_p50: float
    branches: bool | None = None  # the draft pre-drafted outcomes (None: no draft)
    # From the sink's draft book over the cell (specserve.acceptance.branches):
    branch_hit_rate: float | None = None
    coverage_after_rejected: float | None = None
    wait_ms_per_step: float | None = None
    # Engine steps over the cell (batched: one step carries every row in flight).
    engine_steps: int | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def figures(self) -> Figures:
        """The acceptance figures of this cell (specserve.acceptance.record)."""
        return Figures(output_tokens=self.output_tokens, draft_tokens=self.draft_tokens,
                       accepted_tokens=self.accepted_tokens,
                       steps=max(self.output_tokens - self.accepted_tokens, 0),
                       steps_with_drafts=self.steps_with_drafts)

    @property
    def request_steps(self) -> int:
        return self.figures.steps

    @property
    def coverage(self) -> float | None:
        return self.figures.coverage if self.k else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.figures.acceptance_rate if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.figures.mean_accepted_length if self.steps_with_drafts else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("output_tokens_per_s", "request_steps", "coverage", "acceptance_rate",
                     "mean_accepted_length"):
            d[name] = getattr(self, name)
        return d


async def run_cell(spec, prompts: list[list[int]], max_tokens: int, concurrency: int,
                   system: str, alpha: float | None) -> Cell:
    """All prompts through `spec` (a started LocalSpec), at most `concurrency` at once."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    from specserve.acceptance import branches

    before = dataclasses.replace(spec.totals)
    book_before = branches.total(await spec.sink_figures()) if spec.k else None
    sem = asyncio.Semaphore(concurrency)
    per_token: list[float] = []
    tokens = 0

    async def one(p):
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            out = await spec.generate(p, params)
            per_token.append((time.perf_counter() - t0) * 1000 / max(len(out), 1))
            tokens += len(out)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    after = spec.totals
    book = (branches.figures(branches.minus(branches.total(await spec.sink_figures()),
                                            book_before))
            if book_before is not None else {})
    syn = getattr(spec, "synthetic", None)
    return Cell(
                branches=(spec.speculation.branch_fan_out > 0) if syn is not None else None,
                branch_hit_rate=book.get("branch_hit_rate"),
                coverage_after_rejected=book.get("coverage_after_rejected"),
                wait_ms_per_step=book.get("wait_ms_per_step"),
                system=system, concurrency=concurrency, k=spec.k, alpha=alpha,
                prompts=len(prompts), max_tokens=max_tokens, output_tokens=tokens, wall_s=wall,
                draft_tokens=after.draft_tokens - before.draft_tokens,
                accepted_tokens=after.accepted_tokens - before.accepted_tokens,
                steps_with_drafts=after.num_drafts - before.num_drafts,
                engine_steps=after.steps - before.steps,
                latency_per_token_ms_p50=percentile(per_token, 50))


async def use_synthetic(spec, alpha: float, delay_ms: float = 0.0,
                        branches: bool = True) -> None:
    """Point a LocalSpec whose replay is recorded at a synthetic draft of acceptance
    alpha, pre-drafting branches or not: the draft worker is restarted with the
    same replay (it is cheap: no model), the target engine stays."""
    from specserve.draft.synthetic import SyntheticSpec

    draft = str(SyntheticSpec(alpha, delay_ms))
    fan_out = spec.speculation.branch_fan_out
    want = (fan_out or 3) if branches else 0
    if spec.draft == draft and spec.draft_worker is not None and fan_out == want:
        return
    spec.speculation = spec.speculation.model_copy(update={"branch_fan_out": want})
    await spec.stop_draft()
    spec.draft = draft
    spec.synthetic = SyntheticSpec(alpha, delay_ms)
    await spec._start_synthetic(spec.replay)


# ---- step-cost profile -------------------------------------------------------------------


def _step_point(short: Cell, long: Cell) -> tuple[float, float]:
    """(query tokens per batched step, ms per batched step) from two runs that
    differ only in output length. A batched step carries one request-step of
    each of the C requests in flight (all prompts have the same length).

    The steps are the engine's own count. (Output minus accepted tokens
    undercounts them: a request's last step that verifies all its drafts
    emits one token fewer than it accepted plus one, the bonus falling past
    max_tokens; in the calibrate preset each A = 1 step read about 15 % too
    dear.)"""
    c = min(short.concurrency, short.prompts)
    if long.engine_steps is not None and short.engine_steps is not None:
        d_steps = float(long.engine_steps - short.engine_steps)
        d_tokens = c * d_steps + long.draft_tokens - short.draft_tokens
    else:  # cells measured before engine steps were counted
        d_steps = (long.request_steps - short.request_steps) / c
        d_tokens = (long.request_steps + long.draft_tokens - short.request_steps
                    - short.draft_tokens)
    if d_steps <= 0:
        raise RuntimeError("the longer run took no more steps; measurement failed")
    return d_tokens / d_steps, (long.wall_s - short.wall_s) * 1000 / d_steps


async def profile_points(spec, system: str, alpha: float | None, concurrencies: list[int],
                         prompt_len: int, lengths: tuple[int, int], vocab: int, seed: int,
                         progress=None) -> list[dict]:
    out = []
    for c in concurrencies:
        prompts = random_prompts(c, prompt_len, vocab, seed + c)
        cells = []
        for n in lengths:
            cells.append(await run_cell(spec, prompts, n, c, system, alpha))
        x, ms = _step_point(*cells)
        out.append({"system": system, "alpha": alpha, "k": spec.k, "concurrency": c,
                    "tokens_per_step": x, "step_ms": ms})
        if progress:
            progress(f"profile {system} alpha={alpha} C={c}: {x:.1f} tokens/step, {ms:.2f} ms/step")
    return out


def linear_fit(xy: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) with the slope kept >= 0."""
    n = len(xy)
    mx = sum(x for x, _ in xy) / n
    my = sum(y for _, y in xy) / n
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    slope = max(sum((x - mx) * (y - my) for x, y in xy) / sxx, 0.0) if sxx else 0.0
    return max(my - slope * mx, 0.0), slope


def profile_from_points(points: list[dict], source: str, gpus: int = 1,
                        max_num_seqs: int = 64, draft_step_ms: float = 0.0,
                        linear: bool = False) -> dict:
    """A specserve-profile/1 dict from measured points.

    target.step_ms: target-only points (x = batch) and the A = 1 speculative
    points (x = query tokens per step) with the proposer's overhead taken out;
    spec_overhead_ms: what an A = 0 speculative step costs over a target-only
    step of as many query tokens (the target-only points, interpolated; never
    below 0). The draft is the synthetic one: `draft_step_ms`.
    linear: replace the points by a least-squares line through them, and
    price a prompt token as the line prices a query token (a compute-bound
    CPU prefills at the rate it verifies; the points themselves hold no
    prefill: the two runs of a point share their prompts).
    """
    from specserve.tools.simulate.profile import StepProfile

    def shape(xy: dict[float, list[float]]) -> tuple[list[tuple[float, float]], float]:
        """(points, slope): the mean per x, or a line through them when linear."""
        pts = sorted((x, max(sum(v) / len(v), 0.0)) for x, v in xy.items())
        if not (linear and len(pts) >= 2):
            return pts, 0.0
        # One straight line through all points (compute-bound CPU): robust to
        # the noise of a shared machine, where single points can be off by 30 %.
        a, b = linear_fit(pts)
        return [(pts[0][0], a + b * pts[0][0]), (pts[-1][0], a + b * pts[-1][0])], b

    base: dict[float, list[float]] = {}
    for p in points:
        if p["system"] == "target_only":
            base.setdefault(round(p["tokens_per_step"], 2), []).append(p["step_ms"])
    zeros = [p for p in points if p["system"] == "specserve_synthetic" and p["alpha"] == 0.0]
    overhead = 0.0
    if base and zeros:
        plain = StepProfile(tuple(shape(base)[0]))
        overhead = max(sum(p["step_ms"] - plain(p["tokens_per_step"]) for p in zeros)
                       / len(zeros), 0.0)
    pts = {x: list(v) for x, v in base.items()}
    for p in points:
        if p["system"] == "specserve_synthetic" and p["alpha"] == 1.0:
            pts.setdefault(round(p["tokens_per_step"], 2), []).append(p["step_ms"] - overhead)
    step, slope = shape(pts)
    return {
        "format": "specserve-profile/1", "source": source,
        "target": {"step_ms": {"points": [list(p) for p in step], "per_seq_ms": 0.0},
                   "prefill_ms_per_token": slope, "spec_overhead_ms": overhead,
                   "gpus": gpus, "max_num_seqs": max_num_seqs},
        "draft": {"step_ms": draft_step_ms, "prefill_ms_per_token": 0.0, "restart_ms": 0.0,
                  "gpus": 1},
        "measured_points": points,
    }


def progress_printer(prefix: str, t0: float | None = None):
    t0 = time.monotonic() if t0 is None else t0

    def say(msg: str) -> None:
        print(f"[{prefix} {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def write_json(path: Path | str, data) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
