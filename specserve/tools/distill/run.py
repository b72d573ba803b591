"""Distilling a small draft model out of its own target (`specserve distill`).

No small model shares SmolLM2's tokenizer, so the draft is built from the
target itself: N of its layers (evenly spaced, first and last included), its
final norm, and its tied embedding, which stays frozen and shared (it is not
stored with the draft; nor is an untied output layer). The layers are then
trained to match the target's next-token distribution on text the target wrote.

This module owns the training loop (`train`: time budget, progress bar on
stderr, periodic checkpoints it resumes from, alpha before and after; the
optimizer and autocast it trains with, `make_optimizer` and `train_autocast`,
which online adaptation reuses) and the whole run (`run`: data, training,
export). The rest of the package:
- `recipe`: the pure parts (layers, prompts, loss, agreement, schedule);
- `state`: the output folder and `distill.json`, resuming;
- `data`: generating the data with the target in vLLM;
- `draft`: the torch draft, its evaluation, export and assembly.

The output folder OUT holds the Hugging Face draft (config.json,
model.safetensors, tokenizer) plus `distill.json` (settings, data sizes,
alpha before/after, history), `data/` (shards) and `checkpoint.pt`.
It never serves or speculates; it only builds a model.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from specserve.tools.distill.data import generate_data, load_train
from specserve.tools.distill.draft import (
    build_draft, draft_logits, evaluate_alpha, export_draft, trained_tensors,
)
from specserve.tools.distill.recipe import (
    DistillError, learning_rate, progress_line, topk_distill_loss,
)
from specserve.tools.distill.state import (
    CHECKPOINT_FILE, DATA_DIR, DistillState, EVAL_FILE, check_target, log, open_out,
)

# ---- training --------------------------------------------------------------------


def make_optimizer(params, lr: float):
    """AdamW as distillation uses it (no weight decay: the draft starts from the
    target's own weights; beta2 0.98 for short runs)."""
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))


def train_autocast(bf16: bool = True):
    """bf16 autocast on CPU around the forward pass (float32 master weights)."""
    import torch

    return (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
            else torch.autocast("cpu", enabled=False))


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
        log(f"held-out greedy agreement of the target itself: {state.target_alpha:.3f}")
        state.save(out)
    model, trainable = build_draft(state.target, state.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, lr)
    epoch, position = 0, 0
    ckpt = out / CHECKPOINT_FILE
    if ckpt.is_file():
        saved = torch.load(ckpt)
        model.load_state_dict(saved["tensors"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        epoch, position = saved["epoch"], saved["position"]
        log(f"resuming from {ckpt}: step {state.steps}, {state.tokens_trained} tokens trained")
    if state.alpha_before is None:
        state.alpha_before = evaluate_alpha(model, eval_data)
        log(f"held-out greedy agreement before training: {state.alpha_before:.3f}")
        state.save(out)
    autocast = train_autocast(bf16)

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
    log(f"held-out greedy agreement: {state.alpha_before:.3f} before, {state.alpha_after:.3f} "
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
    log(f"draft of {len(state.layers)} layers {state.layers} of {state.target_layers} "
         f"from {target_dir} -> {out_dir}")
    generate_data(out_dir, state, train_tokens, data_minutes, eval_count=eval_count,
                  max_tokens=answer_tokens)
    if data_only:
        return state
    train(out_dir, state, minutes, lr=lr, checkpoint_minutes=checkpoint_minutes, threads=threads)
    return state
