"""Measure online adaptation's training slice on a domain the shipped draft never saw.

    PYTHONPATH=. .venv/bin/python scripts/adapt_domain.py OUT [--minutes 5 10] [--lr 1e-3]

The default target (float32, transformers, greedy, batched) answers the tool-call
domain's prompts (specserve.adapt.domain, fixed seed: a training half and a
held-out half); the shipped default draft is fine-tuned on the training half
(`run_in_subprocess`, threads=1, once per budget in --minutes, the runs side by
side); held-out alpha of the shipped draft, each fine-tuned copy and the target
itself is printed and written to OUT/adapt-domain.json with the wall times.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def target_answers(target: Path, conversations, max_new_tokens: int, batch: int = 16):
    """(context ids, greedy continuation ids) per conversation, from the target in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompts = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for c in conversations]
    out = []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(map(len, group))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad)
        for p, row in zip(group, gen[:, width:].tolist()):
            if tok.eos_token_id in row:
                row = row[:row.index(tok.eos_token_id) + 1]
            out.append((p, row))
    return out


def main() -> None:
    from specserve import models
    from specserve.adapt.domain import domain_split
    from specserve.adapt.evaluate import heldout_alpha
    from specserve.adapt.train import run_in_subprocess

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, nargs="+", default=[5.0, 10.0])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train", type=int, default=96)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft = models.ensure_default_model(), models.ensure_default_draft()
    record: dict = {"lr": args.lr, "threads": 1}

    data_file = out / "data.json"
    t0 = time.monotonic()
    if data_file.is_file():
        data = json.loads(data_file.read_text())
    else:
        train_c, held_c = domain_split(args.train, args.heldout, seed=0)
        answers = target_answers(target, train_c + held_c, args.max_new_tokens)
        data = {"train": answers[:len(train_c)], "heldout": answers[len(train_c):]}
        data_file.write_text(json.dumps(data))
    record["data_seconds"] = round(time.monotonic() - t0, 1)
    train, held = data["train"], data["heldout"]
    record["train_tokens"] = sum(len(c) for _, c in train)
    record["heldout_tokens"] = sum(len(c) for _, c in held)
    print(f"data: {len(train)} training answers ({record['train_tokens']} tokens), "
          f"{len(held)} held-out ({record['heldout_tokens']} tokens), "
          f"{record['data_seconds']} s", flush=True)

    def alpha(folder) -> float:
        a, n = heldout_alpha(folder, held, threads=1)
        return round(a / n, 4)

    record["alpha_target"] = alpha(target)
    record["alpha_shipped"] = alpha(draft)
    print(f"held-out alpha: target {record['alpha_target']}, shipped draft "
          f"{record['alpha_shipped']}", flush=True)

    def tune(minutes: float) -> dict:
        dest = out / f"adapted-{minutes:g}min"
        started = time.monotonic()
        result = run_in_subprocess(draft, train, dest, minutes=minutes, threads=1, lr=args.lr,
                                   seed=0)
        wall = time.monotonic() - started
        return {"minutes": minutes, "wall_seconds": round(wall, 1), "steps": result.steps,
                "tokens": result.tokens, "loss_first": round(result.loss_first, 4),
                "loss_last": round(result.loss_last, 4), "alpha": alpha(dest)}

    with ThreadPoolExecutor(len(args.minutes)) as pool:
        record["runs"] = list(pool.map(tune, args.minutes))
    for r in record["runs"]:
        print(f"fine-tuned {r['minutes']:g} min: held-out alpha {r['alpha']} "
              f"({r['alpha'] / record['alpha_shipped']:.2f}x the shipped draft's), "
              f"{r['steps']} steps, {r['tokens']} tokens, loss {r['loss_first']} -> "
              f"{r['loss_last']}, {r['wall_seconds']} s wall", flush=True)
    (out / "adapt-domain.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
