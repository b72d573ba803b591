"""The pure recipe of a distilled draft: which layers, which prompts, which loss.

Owns the choices that make a draft out of its target, as functions of numbers
and strings (no files, no engines): the layers a draft keeps
(`select_layers`), the prompts (seed topics x tasks, the held-out split by
topic: `split_topics`, `training_prompts`, `question_prompts`,
`eval_prompts`), the distillation loss on the target's top-k log-probs
(`topk_distill_loss`), the greedy agreement alpha (`greedy_agreement`), the recovery hits of
branches (`recovery_hits`), the
learning-rate schedule (`learning_rate`) and the progress line.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

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
