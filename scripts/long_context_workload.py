"""The data-plane issue's real-engine check at a larger batch, its inputs (not a test):
`PYTHONPATH=. .venv/bin/python scripts/long_context_workload.py DIR`.

Writes into DIR a tiny target with an 8 192-token context
(`specserve.testing.tiny.build_model`: 2 layers, a byte-level tokenizer, so a
prompt of N ASCII characters is about N tokens) and two prompt files cut from
Spec-Bench's first turns (`../shared/data/spec_bench_dev.jsonl` by default):
`long.jsonl` (64 prompts of ~4 000 characters: consecutive first turns joined
until long enough, then cut) and `short.jsonl` (the same prompts cut at 200).
Deterministic: the same files every time. Then run, for each file
(docs/benchmarks.md, "The real engine at a larger batch"):

    specserve bench --target DIR/target --prompts DIR/long.jsonl --num-prompts 64 \
      --max-tokens 512 --concurrency 64 --synthetic-alpha 0.8 \
      --systems target_only specserve_synthetic --rounds 1 --max-model-len 8192 \
      --kv-cache-gib 4 --json F
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"


def first_turns(source: Path) -> list[str]:
    turns = []
    for line in source.read_text().splitlines():
        if line.strip():
            turn = json.loads(line)["turns"][0]
            turns.append(turn.encode("ascii", "ignore").decode())
    return turns


def long_prompts(turns: list[str], count: int, chars: int) -> list[str]:
    """`count` prompts of `chars` characters, each joining consecutive turns from its own start."""
    prompts = []
    for i in range(count):
        text, j = "", i
        while len(text) < chars:
            text += turns[j % len(turns)] + "\n\n"
            j += 1
        prompts.append(text[:chars])
    return prompts


def write_prompts(path: Path, prompts: list[str], category: str) -> None:
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"question_id": f"{category}-{i}", "category": category,
                                "turns": [p]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--long-chars", type=int, default=4000)
    parser.add_argument("--short-chars", type=int, default=200)
    args = parser.parse_args()
    if not args.source.is_file():
        parser.error(f"no prompt source at {args.source}")
    from specserve.testing.tiny import build_model

    args.dir.mkdir(parents=True, exist_ok=True)
    build_model(args.dir / "target", max_len=8192)
    prompts = long_prompts(first_turns(args.source), args.num_prompts, args.long_chars)
    write_prompts(args.dir / "long.jsonl", prompts, "long")
    write_prompts(args.dir / "short.jsonl", [p[: args.short_chars] for p in prompts], "short")
    print(f"wrote {args.dir / 'target'}, {args.dir / 'long.jsonl'}, {args.dir / 'short.jsonl'}")


if __name__ == "__main__":
    main()
