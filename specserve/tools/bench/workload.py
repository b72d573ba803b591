"""What a bench run runs: the systems, the prompts, the arguments (pure, no I/O).

Owns the Spec-Bench prompt format (parsing, choosing a sample that covers every
category) and `BenchArgs`, the one description of a run that the backends, the
runner and the report read. Never starts an engine or measures anything.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

SYSTEMS = ("target_only", "specserve_k0", "vllm_draft_model", "vllm_ngram", "vllm_suffix",
           "specserve", "specserve_adapted", "specserve_suffix", "specserve_hybrid",
           "specserve_synthetic", "vllm_serve", "specserve_http")
# What runs without --systems: the drafts with a suffix memory (vllm_ngram,
# vllm_suffix, specserve_suffix, specserve_hybrid) pay on workloads that repeat
# themselves (specserve/data/edit_sample.jsonl) and run when named;
# specserve_adapted (specserve with --adapted-draft) runs when named.
NAMED_ONLY = ("vllm_ngram", "vllm_suffix", "specserve_adapted", "specserve_suffix",
              "specserve_hybrid")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in NAMED_ONLY)
SAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "spec_bench_sample.jsonl"


@dataclasses.dataclass
class Prompt:
    question_id: str
    category: str
    text: str  # the first turn, sent as one user chat message
    ids: list[int] = dataclasses.field(default_factory=list)
    system: str | None = None  # a system message before it (optional "system" key)

    def messages(self) -> list[dict]:
        """The chat messages the prompt is sent as."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.text}]


def parse_prompts(lines: list[str], source: str = "prompts") -> list[Prompt]:
    """Spec-Bench JSONL (question_id, category, turns; optionally a "system"
    message) -> prompts; first turn only."""
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
        system = r.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"{source}:{n}: system must be a string")
        out.append(Prompt(str(r.get("question_id", n)), str(r.get("category", "none")), text,
                          system=system or None))
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
    branch_fan_out: int | None = None  # F for every speculative system (None: the config's)
    adapted_draft: str | None = None  # specserve_adapted's draft (an adapted version's folder)
    fixed_k: bool = False  # specserve and specserve_adapted draft at K for every request

    def speculation(self):
        """The SpeculationConfig every speculative system runs with."""
        from specserve.config import SpeculationConfig

        extra = {} if self.branch_fan_out is None else {"branch_fan_out": self.branch_fan_out}
        return SpeculationConfig(num_speculative_tokens=self.k, **extra)

