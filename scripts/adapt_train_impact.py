"""The target's tokens/s while a draft replica trains (issue 29: within 3 % of before).

    PYTHONPATH=. .venv/bin/python scripts/adapt_train_impact.py OUT [--pairs 3]
        [--train-minutes 1] [--concurrency 2] [--max-tokens 64]

The default target runs as `cluster/online-adapt.yaml` places it on this machine:
its engine on the target's core (`cpu_binding(1, model_draft=True)`: core 0 of 2),
float32, target-only, driven by a closed loop of C clients over the tool-call
domain's prompts (`specserve.adapt.domain`, fixed seed). Windows alternate, the
first without training:
- without: the target alone, for as long as the last window with training took;
- with: one adapter round in a training process started the adapter's own way
  (`specserve.adapt.adapter._training_process`: nice 10, `train_threads` 1, the
  draft's cores) running the adapter's own round (`train_round`: the serving
  weights measured on the held-out slice, a copy of the shipped draft fine-tuned
  for `--train-minutes` on the training half, the copy measured), while the
  target serves.
The training examples are the domain's prompts with the target's own answers
(transformers, greedy, made once and kept in OUT/data.json). What is not here:
the draft engine itself, which shares the draft's core with training as served.
Per window: tokens/s; printed, and with the ratio of the mean with training to
the mean without written to OUT/train-impact.json.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path


def say(msg: str) -> None:
    print(f"[impact {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def serve_until(engine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                      stop) -> tuple[int, float]:
    """A closed loop of `concurrency` clients over `prompts` (in turn) until
    `stop()` says so; (tokens generated, seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, turn = 0, 0
    started = time.monotonic()

    async def client() -> None:
        nonlocal tokens, turn
        while not stop():
            ids = prompts[turn % len(prompts)]
            turn += 1
            last = None
            async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params,
                                             uuid.uuid4().hex):
                last = out
            tokens += len(last.outputs[0].token_ids)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tokens, time.monotonic() - started


async def run(args, out: Path) -> dict:
    from scripts.adapt_domain import target_answers
    from specserve import models
    from specserve.adapt.adapter import _training_process, train_round
    from specserve.adapt.buffer import Example
    from specserve.adapt.domain import domain_split
    from specserve.engine import EngineSettings, cpu_binding
    from specserve.target.engine import TargetEngine

    target, draft = models.ensure_default_model(), models.ensure_default_draft()
    data_file = out / "data.json"
    if not data_file.is_file():
        say("the target answers the domain's prompts (transformers, once)")
        train_c, held_c = domain_split(96, 32, seed=0)
        answers = target_answers(target, train_c + held_c, 64)
        data_file.write_text(json.dumps({"train": answers[:96], "heldout": answers[96:]}))
    data = json.loads(data_file.read_text())
    examples = {part: [Example(f"{part}-{i}", c, a) for i, (c, a) in enumerate(rows)]
                for part, rows in data.items()}
    prompts = [c for c, _ in data["heldout"]]

    target_cpus, draft_cpus = cpu_binding(1, model_draft=True)
    say(f"target engine on core(s) {target_cpus}; training on {draft_cpus}")
    started = TargetEngine.start(str(target), EngineSettings(dtype="float32", seed=0,
                                                             kv_cache_gib=1), cpus=target_cpus)
    pool = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"),
        initializer=_training_process, initargs=(1, draft_cpus))
    windows: list[dict] = []
    try:
        engine = started.engine
        end = time.monotonic() + 20  # warm-up
        await serve_until(engine, prompts, args.concurrency, args.max_tokens,
                          lambda: time.monotonic() >= end)
        with tempfile.TemporaryDirectory(prefix="impact-") as tmp:
            last_training = None
            for n in range(2 * args.pairs):
                training = n % 2 == 1
                if training:
                    folder = str(Path(tmp) / f"candidate-{n}")
                    job = pool.submit(train_round, str(draft), str(draft), examples["train"],
                                      examples["heldout"], folder, args.train_minutes, 1,
                                      1e-3)
                    tokens, seconds = await serve_until(engine, prompts, args.concurrency,
                                                        args.max_tokens, job.done)
                    result = job.result()
                    last_training = seconds
                    extra = {"steps": result["train"]["steps"],
                             "alpha": [result["serving"], result["candidate"]]}
                else:
                    length = last_training or 60 * args.train_minutes + 30
                    end = time.monotonic() + length
                    tokens, seconds = await serve_until(engine, prompts, args.concurrency,
                                                        args.max_tokens,
                                                        lambda: time.monotonic() >= end)
                    extra = {}
                w = {"training": training, "tokens": tokens, "seconds": round(seconds, 1),
                     "tokens_per_s": round(tokens / seconds, 2), **extra}
                windows.append(w)
                say(f"window {n + 1}/{2 * args.pairs}: {json.dumps(w)}")
    finally:
        pool.shutdown(cancel_futures=True)
        started.shutdown()
    alone = [w["tokens_per_s"] for w in windows if not w["training"]]
    training = [w["tokens_per_s"] for w in windows if w["training"]]
    return {"concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "train_minutes": args.train_minutes, "target_cpus": target_cpus,
            "training_cpus": draft_cpus, "windows": windows,
            "tokens_per_s_alone": round(statistics.mean(alone), 2),
            "tokens_per_s_training": round(statistics.mean(training), 2),
            "ratio": round(statistics.mean(training) / statistics.mean(alone), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--pairs", type=int, default=3, help="windows without and with training")
    ap.add_argument("--train-minutes", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args, out))
    (out / "train-impact.json").write_text(json.dumps(report, indent=1))
    print(f"target tokens/s alone {report['tokens_per_s_alone']}, while training "
          f"{report['tokens_per_s_training']}: ratio {report['ratio']}")


if __name__ == "__main__":
    main()
