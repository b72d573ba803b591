"""Distilling a small draft model out of its own target (`specserve distill`).

No small model shares SmolLM2's tokenizer, so the draft is built from the
target itself: N of its layers (evenly spaced, first and last included), its
final norm, and its tied embedding, which stays frozen and shared (it is not
stored with the draft; nor is an untied output layer). The layers are then
trained to match the target's next-token distribution on text the target wrote.

This module owns:
- the pure parts: which layers a draft keeps (`select_layers`), the prompts
  (seed topics x tasks, the held-out split by topic: `split_topics`,
  `training_prompts`, `eval_prompts`), the distillation loss on the target's
  top-k log-probs (`topk_distill_loss`) and the greedy agreement alpha
  (`greedy_agreement`), the learning-rate schedule (`learning_rate`);
- generating the data with the target in vLLM (`generate_data`): sampled
  answers with the target's top-k log-probs for training, greedy answers to
  held-out prompts for evaluation; in rounds saved as shards, so it resumes;
- the training loop (`train`): time budget, progress bar on stderr, periodic
  checkpoints it resumes from, alpha before and after;
- writing the draft: a normal Hugging Face folder (`export_draft`) and the
  trained tensors alone (`draft-layers.safetensors`), which `assemble_draft`
  turns back into a folder given the target (how the shipped default draft is
  loaded, see specserve.models.ensure_default_draft).

The output folder OUT holds the Hugging Face draft (config.json,
model.safetensors, tokenizer) plus `distill.json` (settings, data sizes,
alpha before/after, history), `data/` (shards) and `checkpoint.pt`.
It never serves or speculates; it only builds a model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "distill.json"
LAYERS_FILE = "draft-layers.safetensors"
CHECKPOINT_FILE = "checkpoint.pt"
DATA_DIR = "data"
EVAL_FILE = "eval.pt"
DATA_STATE_FILE = "data.json"
DATA_FIELDS = ("data_rounds", "train_sequences", "train_tokens", "eval_sequences",
               "eval_tokens", "data_seconds")
# Taken from the target when the draft is assembled, never stored with it
# (lm_head only exists separately in targets that do not tie it to the embedding).
SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")

# Every HELD_OUT_EVERY-th topic is never used for training prompts.
HELD_OUT_EVERY = 8

TOPICS = [
    "the water cycle", "photosynthesis", "black holes", "the French Revolution",
    "machine learning", "climate change", "the human heart", "volcanoes", "ancient Rome",
    "the stock market", "vaccines", "electric cars", "the internet", "honey bees",
    "the Renaissance", "quantum computing", "coral reefs", "the Moon landing",
    "healthy sleep", "personal budgeting", "job interviews", "learning a language",
    "the Great Wall of China", "earthquakes", "solar energy", "recycling", "chess",
    "the Olympic Games", "jazz music", "coffee", "dinosaurs", "the immune system",
    "democracy", "inflation", "social media", "time management", "public speaking",
    "gardening", "the solar system", "plate tectonics", "DNA", "antibiotics",
    "the printing press", "World War II", "the Industrial Revolution", "rainforests",
    "deserts", "the ocean tides", "gravity", "electricity", "magnets", "rainbows",
    "baking bread", "cooking pasta", "running a marathon", "yoga", "meditation",
    "friendship", "writing a resume", "starting a small business", "cryptocurrency",
    "renewable energy", "nuclear power", "the periodic table", "prime numbers",
    "fractions", "probability", "the Pythagorean theorem", "sorting algorithms",
    "Python lists", "recursion", "databases", "web browsers", "password security",
    "email etiquette", "remote work", "the history of cinema", "Shakespeare",
    "poetry", "the Amazon river", "mountain climbing", "penguins", "wolves", "cats",
    "dogs", "tea", "chocolate", "pizza", "bicycles", "airplanes", "trains",
    "the human brain", "memory", "habits", "stress", "teamwork", "leadership",
    "negotiation", "museums", "libraries", "volunteering", "urban planning",
    "traffic", "weather forecasts", "hurricanes", "snow", "the Arctic", "Mars",
    "telescopes", "microscopes", "bacteria", "viruses", "nutrition", "vitamins",
    "exercise", "the Roman alphabet", "translation", "grammar", "storytelling",
    "video games", "board games", "photography", "painting", "architecture",
    "bridges", "skyscrapers", "the Silk Road", "pirates", "knights", "the pyramids",
    "Greek mythology", "philosophy", "ethics", "logic puzzles", "mathematics proofs",
    "statistics", "spreadsheets", "smartphones", "batteries", "robots", "3D printing",
]

TASKS = [
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?",
    "Give me a step-by-step guide related to {topic}.",
    "Write a short story that involves {topic}.",
    "What are the pros and cons of {topic}?",
    "Explain {topic} to a ten-year-old child.",
    "Write a short poem about {topic}.",
    "Summarize the most important ideas about {topic} in a few bullet points.",
    "What is a common misconception about {topic}?",
    "Write an email to a friend about {topic}.",
    "How would you teach a beginner about {topic}?",
    "Compare {topic} with something similar and explain the differences.",
    "Write a short dialogue between two people discussing {topic}.",
    "What questions do people often ask about {topic}? Answer one of them.",
    "Describe the history of {topic} briefly.",
]

# Asked of the target to get varied prompts in its own words.
QUESTION_TASK = ("Write one question that a curious person might ask about {topic}. "
                 "Reply with the question only.")


class DistillError(ValueError):
    """Bad input to `specserve distill`; the message says what to do."""


# ---- pure parts ----------------------------------------------------------------


def select_layers(num_target_layers: int, n: int) -> list[int]:
    """n target layer indices, evenly spaced, first and last included.

    >>> select_layers(30, 4)
    [0, 10, 19, 29]
    """
    if num_target_layers < 1:
        raise DistillError(f"the target has {num_target_layers} layers; it needs at least one")
    if not 1 <= n <= num_target_layers:
        raise DistillError(f"--layers must be between 1 and the target's {num_target_layers} "
                           f"layers, got {n}")
    if n == 1:
        return [0]
    last = num_target_layers - 1
    return sorted({round(i * last / (n - 1)) for i in range(n)})


def split_topics(topics: Sequence[str] = TOPICS) -> tuple[list[str], list[str]]:
    """(training topics, held-out topics): disjoint, every HELD_OUT_EVERY-th held out."""
    held = [t for i, t in enumerate(topics) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [t for i, t in enumerate(topics) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held


def training_prompts(round_index: int, count: int, seed: int = 0) -> list[str]:
    """`count` prompts for generation round `round_index`: training topics x tasks."""
    train, _ = split_topics()
    rng = random.Random(f"{seed}-{round_index}")
    return [rng.choice(TASKS).format(topic=rng.choice(train)) for _ in range(count)]


def question_prompts(round_index: int, count: int, seed: int = 0) -> list[str]:
    """Prompts asking the target to write a question about a training topic."""
    train, _ = split_topics()
    rng = random.Random(f"q-{seed}-{round_index}")
    return [QUESTION_TASK.format(topic=rng.choice(train)) for _ in range(count)]


def eval_prompts(count: int) -> list[str]:
    """Held-out prompts: topics never used for training, tasks in turn."""
    _, held = split_topics()
    return [TASKS[i % len(TASKS)].format(topic=held[(i * 7) % len(held)]) for i in range(count)]


def greedy_agreement(draft_argmax, target_next) -> tuple[int, int]:
    """(agreeing positions, positions): the draft's greedy token against the target's.

    On text the target wrote greedily, the target's greedy next token at a
    position is simply the next token of the text, so `target_next` is the text
    shifted by one. alpha = agreeing / positions.
    """
    if len(draft_argmax) != len(target_next):
        raise ValueError(f"{len(draft_argmax)} draft tokens against {len(target_next)} target tokens")
    agree = sum(1 for d, t in zip(draft_argmax, target_next) if int(d) == int(t))
    return agree, len(target_next)


def topk_distill_loss(draft_logits, topk_ids, topk_logprobs):
    """Cross-entropy of the draft against the target's top-k, renormalized.

    draft_logits: (n, V) draft logits at n positions; topk_ids (n, k) and
    topk_logprobs (n, k): the target's k most likely next tokens there and
    their log-probs. p = softmax(topk_logprobs) puts the target's mass on its
    top k (the rest is ~0 for a peaked model); the loss is
    -sum_k p_k log q(id_k), q the draft's full softmax. Its gradient equals
    that of KL(p || q). Returns the mean over positions.
    """
    import torch

    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    p = torch.softmax(topk_logprobs.float(), dim=-1)
    return -(p * log_q.gather(-1, topk_ids.long())).sum(-1).mean()


def learning_rate(step: int, elapsed_fraction: float, base: float, warmup_steps: int = 20) -> float:
    """Linear warm-up over the first steps, then cosine decay to 10% over the time budget."""
    warm = min(1.0, (step + 1) / warmup_steps)
    f = min(max(elapsed_fraction, 0.0), 1.0)
    return base * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * f)))


def progress_line(elapsed: float, budget: float, step: int, tokens: int, loss: float,
                  agree: float, width: int = 24) -> str:
    """One progress-bar line: bar, time, step, tokens, loss, train agreement."""
    frac = min(elapsed / budget, 1.0) if budget > 0 else 1.0
    bar = "#" * int(frac * width) + "." * (width - int(frac * width))
    return (f"distill [{bar}] {elapsed / 60:5.1f}/{budget / 60:.1f} min  step {step}  "
            f"{tokens / 1000:.0f}k tokens  loss {loss:.3f}  train agreement {agree:.3f}")


# ---- settings and state ----------------------------------------------------------


@dataclass
class DistillState:
    """What `distill.json` records; a folder with it is a previous run to resume."""

    target: str
    target_layers: int
    layers: list[int]
    top_k: int
    seed: int
    data_rounds: int = 0
    train_sequences: int = 0
    train_tokens: int = 0
    eval_sequences: int = 0
    eval_tokens: int = 0
    data_seconds: float = 0.0
    steps: int = 0
    tokens_trained: int = 0
    train_seconds: float = 0.0
    alpha_before: float | None = None
    alpha_after: float | None = None
    target_alpha: float | None = None
    history: list[dict] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    def save(self, out: Path) -> None:
        """Write distill.json, with the data figures as the data generator last wrote them."""
        self.refresh_data(out)
        if (out / STATE_FILE).is_file():
            # Keep commands another run (e.g. a data run) recorded meanwhile.
            on_disk = json.loads((out / STATE_FILE).read_text()).get("commands", [])
            self.commands = [c for c in on_disk if c not in self.commands] + self.commands
        _write_json(out / STATE_FILE, asdict(self))

    def save_data(self, out: Path) -> None:
        """Write the data figures alone (data/data.json): a data run and a training
        run may share OUT, and neither must overwrite the other's figures."""
        _write_json(out / DATA_DIR / DATA_STATE_FILE, {k: getattr(self, k) for k in DATA_FIELDS})

    def refresh_data(self, out: Path) -> None:
        path = out / DATA_DIR / DATA_STATE_FILE
        if path.is_file():
            for key, value in json.loads(path.read_text()).items():
                setattr(self, key, value)

    @classmethod
    def load(cls, out: Path) -> DistillState:
        state = cls(**json.loads((out / STATE_FILE).read_text()))
        state.refresh_data(out)
        return state


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def check_target(target: str | Path) -> Path:
    """The target folder, or a DistillError that says what is wrong."""
    path = Path(target)
    if not path.is_dir():
        raise DistillError(f"target model folder {target} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise DistillError(f"target model folder {target} has no config.json; "
                           "pass a Hugging Face model folder")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "llama":
        raise DistillError(f"target {target} is a {config.get('model_type')!r} model; "
                           "distill supports Llama-architecture targets (e.g. SmolLM2)")
    return path.resolve()


def open_out(out: str | Path, target: Path, n_layers: int, top_k: int, seed: int) -> DistillState:
    """Create OUT, or resume the previous run in it; refuse anything else."""
    from transformers import AutoConfig

    out = Path(out)
    config = AutoConfig.from_pretrained(target)
    layers = select_layers(config.num_hidden_layers, n_layers)
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {out} is a file; pass a new folder")
    if out.is_dir() and (out / STATE_FILE).is_file():
        state = DistillState.load(out)
        if (state.target, state.layers, state.top_k) != (str(target), layers, top_k):
            raise DistillError(
                f"--out {out} holds a distillation of {state.target} with layers {state.layers} "
                f"and top-{state.top_k}, not of {target} with layers {layers} and top-{top_k}; "
                "pass the same settings to resume, or a new folder")
        return state
    if out.is_dir() and any(out.iterdir()):
        raise DistillError(f"--out {out} exists and is not a previous distill run (no "
                           f"{STATE_FILE}); pass a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    state = DistillState(target=str(target), target_layers=config.num_hidden_layers,
                         layers=layers, top_k=top_k, seed=seed)
    state.save(out)
    return state


def _log(message: str) -> None:
    print(f"specserve distill: {message}", file=sys.stderr, flush=True)


# ---- data (vLLM) -----------------------------------------------------------------


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _topk(position_logprobs, k: int) -> tuple[list[int], list[float]]:
    """The k most likely ids and log-probs at one position (vLLM may add the sampled one)."""
    items = sorted(position_logprobs.items(), key=lambda kv: -kv[1].logprob)[:k]
    ids = [i for i, _ in items]
    lps = [max(float(lp.logprob), -1e4) for _, lp in items]
    while len(ids) < k:  # fewer than k distinct entries: pad with impossible tokens
        ids.append(ids[0])
        lps.append(-1e4)
    return ids, lps


def generate_data(out: Path, state: DistillState, train_tokens: int, minutes: float | None,
                  eval_count: int = 48, round_prompts: int = 96, max_tokens: int = 320,
                  temperature: float = 0.8) -> None:
    """Generate training shards until `train_tokens` or `minutes` (whichever first).

    Training: prompts of training topics (half given, half written by the
    target itself), answers sampled at `temperature` with the target's top-k
    log-probs at every answer position. Evaluation: held-out prompts answered
    greedily. Each round is one shard file, so an interrupted run resumes.
    """
    import torch
    from transformers import AutoTokenizer

    data = out / DATA_DIR
    data.mkdir(exist_ok=True)
    need_eval = not (data / EVAL_FILE).is_file()
    if not need_eval and state.train_tokens >= train_tokens:
        return
    if minutes is not None and minutes <= 0:
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(state.target)
    llm = LLM(model=state.target, seed=state.seed, max_model_len=1024, max_logprobs=state.top_k,
              enforce_eager=True, max_num_seqs=64)
    max_len = 1024 - max_tokens

    if need_eval:
        prompts = [_chat_ids(tokenizer, p) for p in eval_prompts(eval_count)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens // 2),
                            use_tqdm=False)
        sequences = [{"ids": torch.tensor(list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                                          dtype=torch.int32),
                      "start": len(o.prompt_token_ids)} for o in outs]
        torch.save(sequences, data / EVAL_FILE)
        state.eval_sequences = len(sequences)
        state.eval_tokens = sum(len(s["ids"]) - s["start"] for s in sequences)
        state.save_data(out)
        _log(f"held-out data: {state.eval_sequences} greedy answers, {state.eval_tokens} tokens")

    budget = None if minutes is None else minutes * 60
    while state.train_tokens < train_tokens:
        elapsed = time.monotonic() - started
        if budget is not None and elapsed > budget * 0.6 and state.data_rounds > 0:
            # A round takes a while; do not start one that would overrun the budget much.
            per_round = elapsed / max(1, state.data_rounds)
            if elapsed + per_round > budget:
                break
        r = state.data_rounds
        round_started = time.monotonic()
        # Half the prompts are questions the target writes itself (sampled, so varied).
        asked = llm.generate(
            [TokensPrompt(prompt_token_ids=_chat_ids(tokenizer, p))
             for p in question_prompts(r, round_prompts // 2, state.seed)],
            SamplingParams(temperature=1.0, max_tokens=48), use_tqdm=False)
        questions = [o.outputs[0].text.strip() for o in asked]
        questions = [q for q in questions if 10 <= len(q) <= 300]
        prompts = training_prompts(r, round_prompts - len(questions), state.seed) + questions
        ids = [p for p in (_chat_ids(tokenizer, q) for q in prompts) if len(p) < max_len]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids],
                            SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                           logprobs=state.top_k), use_tqdm=False)
        sequences = []
        for o in outs:
            c = o.outputs[0]
            if not c.token_ids or c.logprobs is None:
                continue
            pairs = [_topk(pos, state.top_k) for pos in c.logprobs]
            sequences.append({
                "ids": torch.tensor(list(o.prompt_token_ids) + list(c.token_ids), dtype=torch.int32),
                "start": len(o.prompt_token_ids),
                "topk_ids": torch.tensor([p[0] for p in pairs], dtype=torch.int32),
                "topk_logprobs": torch.tensor([p[1] for p in pairs], dtype=torch.float16),
            })
        torch.save(sequences, data / f"train-{r:04d}.pt")
        state.data_rounds += 1
        state.train_sequences += len(sequences)
        state.train_tokens += sum(len(s["topk_ids"]) for s in sequences)
        state.data_seconds += time.monotonic() - round_started
        state.save_data(out)
        _log(f"data round {r}: {len(sequences)} answers; {state.train_tokens} of {train_tokens} "
             f"training tokens ({time.monotonic() - round_started:.0f} s)")
    state.save_data(out)
    # Free the engine's processes and memory before training.
    llm.llm_engine.engine_core.shutdown()
    del llm


def load_train(out: Path) -> list[dict]:
    import torch

    shards = sorted((out / DATA_DIR).glob("train-*.pt"))
    return [s for shard in shards for s in torch.load(shard)]


# ---- the draft model (torch) -----------------------------------------------------


def build_draft(target: str | Path, layers: list[int]):
    """A Llama with the target's `layers`, final norm and tied embedding (float32).

    Returns (model, trainable parameter names). The embedding (= output layer)
    is frozen: it is the target's and is not stored with the draft.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src = full.state_dict()
    dst = {}
    for j, i in enumerate(layers):
        for name, tensor in src.items():
            prefix = f"model.layers.{i}."
            if name.startswith(prefix):
                dst[f"model.layers.{j}." + name[len(prefix):]] = tensor
    dst["model.norm.weight"] = src["model.norm.weight"]
    for name in SHARED_TENSORS:
        if name in src:
            dst[name] = src[name]
    missing, unexpected = draft.load_state_dict(dst, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise DistillError(f"cannot build the draft: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        draft.tie_weights()
    del full
    # Shared with the target, never trained (an untied output layer too).
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
    return draft, trainable


def draft_logits(model, ids, start: int):
    """Draft logits at the positions that predict ids[start:] (n, V)."""
    hidden = model.model(input_ids=ids[None, :-1].long()).last_hidden_state[0, start - 1:]
    return model.lm_head(hidden)


def evaluate_alpha(model, eval_data: list[dict]) -> float:
    """Greedy agreement of `model` with the target's greedy held-out text."""
    import torch

    agree = total = 0
    model.eval()
    with torch.no_grad():
        for s in eval_data:
            ids = s["ids"]
            if len(ids) - s["start"] < 1:
                continue
            pred = draft_logits(model, ids, s["start"]).argmax(-1).tolist()
            a, n = greedy_agreement(pred, ids[s["start"]:].tolist())
            agree += a
            total += n
    model.train()
    return agree / total if total else float("nan")


def recovery_hits(ranked, target_next, fan_outs=(1, 2, 3, 4)) -> tuple[dict[int, int], int]:
    """Where the draft's greedy token (ranked[i][0]) is not the target's
    (target_next[i]): how often the target's token is among the draft's F
    next-best (ranked[i][1 : F + 1]), per F; and how many such positions. This is
    the recovery hit rate H of a branch budget of F alternatives per position."""
    hits = {f: 0 for f in fan_outs}
    misses = 0
    for r, t in zip(ranked, target_next):
        if r[0] == t:
            continue
        misses += 1
        rank = r.index(t) if t in r else None  # 1 = the best alternative
        for f in fan_outs:
            if rank is not None and 1 <= rank <= f:
                hits[f] += 1
    return hits, misses


def evaluate_recovery_hit(model, eval_data: list[dict], fan_outs=(1, 2, 3, 4)) -> dict[int, float]:
    """H at each F on held-out text: the target's token among the draft's F
    next-best tokens, where the draft's greedy token was wrong."""
    import torch

    total = {f: 0 for f in fan_outs}
    misses = 0
    model.eval()
    with torch.no_grad():
        for s in eval_data:
            ids = s["ids"]
            if len(ids) - s["start"] < 1:
                continue
            top = draft_logits(model, ids, s["start"]).topk(max(fan_outs) + 1, dim=-1).indices
            h, m = recovery_hits(top.tolist(), ids[s["start"]:].tolist(), fan_outs)
            misses += m
            for f in fan_outs:
                total[f] += h[f]
    return {f: total[f] / misses if misses else float("nan") for f in fan_outs}


def trained_tensors(model, trainable: list[str]) -> dict:
    params = dict(model.named_parameters())
    return {n: params[n].detach() for n in trainable}


def draft_config(target: str | Path, n_layers: int, layers: list[int]) -> dict:
    """The target's config.json with the draft's layer count (and per-layer lists cut)."""
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = n_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i] for i in layers]
    return config


def export_draft(model, trainable: list[str], target: str | Path, out: Path,
                 layers: list[int]) -> None:
    """Write OUT as a Hugging Face folder (bf16) and the trained tensors alone."""
    import torch
    from safetensors.torch import save_file

    tmp = out / ".export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in trained_tensors(model, trainable).items()},
              str(tmp / LAYERS_FILE), metadata={"layers": json.dumps(model.config.num_hidden_layers)})
    assemble_draft(target, tmp / LAYERS_FILE, tmp,
                   config=draft_config(target, model.config.num_hidden_layers, layers))
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def assemble_draft(target: str | Path, layers_file: Path, dest: Path, config: dict) -> None:
    """A Hugging Face draft folder in `dest`: `config` (a draft config dict), the
    target's tokenizer files and generation config, and model.safetensors =
    the trained tensors of `layers_file` + the target's embedding (and output
    layer, if the target does not tie them)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    target = Path(target)
    tensors = load_file(str(layers_file))
    dtype = next(iter(tensors.values())).dtype
    for shard in sorted(target.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in SHARED_TENSORS:
                if name in f.keys():
                    tensors[name] = f.get_tensor(name).to(dtype)
    if "model.embed_tokens.weight" not in tensors:
        raise DistillError(f"target {target} has no model.embed_tokens.weight in its safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    config = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    config["architectures"] = ["LlamaForCausalLM"]
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in target.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in (
                "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                "vocab.json", "merges.txt")):
            shutil.copyfile(f, dest / f.name)


def ship(out: Path, dest: Path) -> None:
    """Copy what a shipped draft needs from OUT into `dest`: the trained tensors,
    the draft config and the run's record (distill.json). No embedding."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (LAYERS_FILE, "config.json", STATE_FILE):
        shutil.copyfile(out / name, dest / name)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- training --------------------------------------------------------------------


def train(out: Path, state: DistillState, minutes: float, lr: float = 3e-4,
          tokens_per_step: int = 2048, checkpoint_minutes: float = 5.0,
          threads: int | None = None, bf16: bool = True) -> None:
    """Distil for `minutes`, resuming from OUT's checkpoint; alpha before and after."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    train_data = load_train(out)
    if not train_data:
        raise DistillError(f"no training data in {out / DATA_DIR}; run without --data-minutes 0 "
                           "so the target generates some")
    eval_data = torch.load(out / DATA_DIR / EVAL_FILE)
    if state.target_alpha is None:
        # The ceiling: the target itself in torch float32 against its own greedy
        # text from vLLM (below 1 only where the two runtimes' numerics differ).
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(state.target, dtype=torch.float32)
        state.target_alpha = evaluate_alpha(full, eval_data)
        del full
        _log(f"held-out greedy agreement of the target itself: {state.target_alpha:.3f}")
        state.save(out)
    model, trainable = build_draft(state.target, state.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    epoch, position = 0, 0
    ckpt = out / CHECKPOINT_FILE
    if ckpt.is_file():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["tensors"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        epoch, position = saved["epoch"], saved["position"]
        _log(f"resuming from {ckpt}: step {state.steps}, {state.tokens_trained} tokens trained")
    if state.alpha_before is None:
        state.alpha_before = evaluate_alpha(model, eval_data)
        _log(f"held-out greedy agreement before training: {state.alpha_before:.3f}")
        state.save(out)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else torch.autocast("cpu", enabled=False))

    budget = minutes * 60
    started = last_ckpt = time.monotonic()
    trained_before = state.train_seconds
    recent_loss, recent_agree, recent_n = 0.0, 0, 0
    last_print = 0.0

    def checkpoint() -> None:
        nonlocal last_ckpt
        state.train_seconds = trained_before + (time.monotonic() - started)
        tmp = out / (CHECKPOINT_FILE + ".tmp")
        torch.save({"tensors": trained_tensors(model, trainable),
                    "optimizer": optimizer.state_dict(), "epoch": epoch, "position": position}, tmp)
        os.replace(tmp, ckpt)
        export_draft(model, trainable, state.target, out, state.layers)
        state.save(out)
        last_ckpt = time.monotonic()

    model.train()
    while time.monotonic() - started < budget:
        order = list(range(len(train_data)))
        random.Random(f"{state.seed}-epoch-{epoch}").shuffle(order)
        if position >= len(order):
            epoch, position = epoch + 1, 0
            # A data run may have added shards meanwhile (OUT is shared).
            train_data = load_train(out)
            continue
        step_tokens = 0
        for g in optimizer.param_groups:
            g["lr"] = learning_rate(state.steps, (time.monotonic() - started) / budget, lr)
        optimizer.zero_grad(set_to_none=True)
        while step_tokens < tokens_per_step and position < len(order):
            s = train_data[order[position]]
            position += 1
            n = len(s["topk_ids"])
            with autocast:
                logits = draft_logits(model, s["ids"], s["start"])
            loss = topk_distill_loss(logits, s["topk_ids"], s["topk_logprobs"])
            (loss * n / tokens_per_step).backward()
            step_tokens += n
            recent_loss += loss.item() * n
            recent_agree += int((logits.argmax(-1) == s["topk_ids"][:, 0]).sum())
            recent_n += n
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        state.steps += 1
        state.tokens_trained += step_tokens
        now = time.monotonic()
        if now - last_print > 2 or now - started >= budget:
            print("\r" + progress_line(now - started, budget, state.steps, state.tokens_trained,
                                       recent_loss / max(recent_n, 1), recent_agree / max(recent_n, 1)),
                  end="", file=sys.stderr, flush=True)
            last_print = now
        if now - last_ckpt > checkpoint_minutes * 60:
            state.history.append({"step": state.steps, "tokens": state.tokens_trained,
                                  "train_seconds": round(trained_before + now - started),
                                  "loss": round(recent_loss / max(recent_n, 1), 4),
                                  "train_agreement": round(recent_agree / max(recent_n, 1), 4)})
            recent_loss, recent_agree, recent_n = 0.0, 0, 0
            checkpoint()
    print(file=sys.stderr)
    state.alpha_after = evaluate_alpha(model, eval_data)
    state.history.append({"step": state.steps, "tokens": state.tokens_trained,
                          "train_seconds": round(trained_before + time.monotonic() - started),
                          "alpha": round(state.alpha_after, 4)})
    checkpoint()
    _log(f"held-out greedy agreement: {state.alpha_before:.3f} before, {state.alpha_after:.3f} "
         f"after ({state.steps} steps, {state.tokens_trained} tokens, "
         f"{state.train_seconds / 60:.1f} min of training)")


def run(target: str, layers: int, out: str, minutes: float, train_tokens: int = 200_000,
        data_minutes: float | None = None, data_only: bool = False, top_k: int = 32,
        seed: int = 0, threads: int | None = None, lr: float = 3e-4,
        checkpoint_minutes: float = 5.0, eval_count: int = 48, answer_tokens: int = 320,
        command: str | None = None) -> DistillState:
    """`specserve distill`: data (if missing), then training; returns the state."""
    target_dir = check_target(target)
    out_dir = Path(out)
    state = open_out(out_dir, target_dir, layers, top_k, seed)
    if command:
        state.commands.append(command)
        state.save(out_dir)
    _log(f"draft of {len(state.layers)} layers {state.layers} of {state.target_layers} "
         f"from {target_dir} -> {out_dir}")
    generate_data(out_dir, state, train_tokens, data_minutes, eval_count=eval_count,
                  max_tokens=answer_tokens)
    if data_only:
        return state
    train(out_dir, state, minutes, lr=lr, checkpoint_minutes=checkpoint_minutes, threads=threads)
    return state
