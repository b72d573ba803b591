"""Fine-tuning a copy of a draft on the traffic it served (online adaptation's training).

Owns `fine_tune`: load a draft's Hugging Face folder, train its layers on
examples (context, the target's verified continuation) with hard labels, and
write the result as a new folder, atomically; and `run_in_subprocess`, the
same in a child process at a lower CPU priority, so that drafting keeps its
share of the cores.

The recipe is `specserve distill`'s, reused rather than restated: what stays
frozen (`freeze_shared`: the embedding and the output layer, shared with the
target), AdamW, bf16 autocast, warm-up then cosine decay over the time
budget, gradient clipping at 1. The loss is the distillation loss with the
target's one verified token as its top-1 at probability 1, i.e. the
cross-entropy on the continuation positions (context positions are not
scored).

Bounded: `minutes` of wall time (checked between steps, so a run ends within
one step of it), `threads` torch threads, `max_steps` if given. The source
folder is only read. Never serves, never judges whether the result is better
(`specserve.adapt.guard` does, on the held-out slice).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue as queue_module
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specserve.adapt.evaluate import batches, continuation_logits, positions, torch_threads
from specserve.tools.distill.draft import freeze_shared
from specserve.tools.distill.recipe import learning_rate, topk_distill_loss
from specserve.tools.distill.run import make_optimizer, train_autocast

# Continuation tokens per optimizer step (gradients accumulated over
# micro-batches of at most MICRO_BATCH_TOKENS padded tokens).
STEP_TOKENS = 2048
MICRO_BATCH_TOKENS = 1024
# Weight files of the source folder; the copy gets the fine-tuned ones instead.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What one fine-tuning run did. Losses: mean cross-entropy per continuation
    token over the first and the last optimizer step."""

    steps: int
    tokens: int
    seconds: float
    loss_first: float
    loss_last: float


def hard_label_loss(logits, targets):
    """Cross-entropy of the draft against the target's verified tokens: the
    distillation loss with each token as the target's top-1 at probability 1."""
    import torch

    return topk_distill_loss(logits, targets[:, None], torch.zeros(len(targets), 1))


def fine_tune(src_folder: str | Path, examples: Sequence, out_folder: str | Path, *,
              minutes: float, threads: int | None, lr: float, max_steps: int | None = None,
              seed: int = 0, progress: Callable[[str], None] | None = None,
              step_tokens: int = STEP_TOKENS) -> TrainResult:
    """Fine-tune a copy of the draft in `src_folder` on `examples`; write it to
    `out_folder` (which must not exist) in the source's dtype, with the source's
    tokenizer and other files."""
    import torch
    from transformers import AutoModelForCausalLM

    src, out = Path(src_folder), Path(out_folder)
    if out.exists():
        raise FileExistsError(f"fine-tune output {out} exists; pass a new folder "
                              "(a draft version is never overwritten)")
    if positions(examples) == 0:
        raise ValueError("no continuation tokens to train on; collect traffic first")
    started = time.monotonic()
    budget = minutes * 60
    with torch_threads(threads):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
        saved_dtype = model.dtype
        model.float()
        trainable = set(freeze_shared(model))
        params = [p for n, p in model.named_parameters() if n in trainable]
        optimizer = make_optimizer(params, lr)
        autocast = train_autocast()
        order = random.Random(seed)
        micro_batches: list = []
        steps = tokens = 0
        loss_first = loss_last = float("nan")
        model.train()
        while (max_steps is None or steps < max_steps) and time.monotonic() - started < budget:
            done = (time.monotonic() - started) / budget if budget > 0 else 1.0
            if max_steps:
                done = max(done, steps / max_steps)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(steps, done, lr)
            optimizer.zero_grad(set_to_none=True)
            n_step, loss_sum = 0, 0.0
            while n_step < step_tokens:
                if not micro_batches:  # a new epoch, in a new order
                    shuffled = list(examples)
                    order.shuffle(shuffled)
                    micro_batches = list(batches(shuffled, MICRO_BATCH_TOKENS))[::-1]
                with autocast:
                    logits, targets = continuation_logits(model, micro_batches.pop())
                loss = hard_label_loss(logits, targets)
                (loss * len(targets) / step_tokens).backward()
                n_step += len(targets)
                loss_sum += loss.item() * len(targets)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            steps, tokens = steps + 1, tokens + n_step
            loss_last = loss_sum / n_step
            if steps == 1:
                loss_first = loss_last
            if progress:
                progress(f"fine-tune step {steps}: loss {loss_last:.3f}, {tokens} tokens, "
                         f"{time.monotonic() - started:.0f} s")
        model.to(saved_dtype)
        _save_atomically(model, src, out)
    return TrainResult(steps=steps, tokens=tokens, seconds=time.monotonic() - started,
                       loss_first=loss_first, loss_last=loss_last)


def _save_atomically(model, src: Path, out: Path) -> None:
    """The source folder's files (tokenizer, generation config, ...) and the
    model's weights and config, written next to `out` and renamed into place."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith(".") and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(f, tmp / f.name)
        model.save_pretrained(str(tmp), safe_serialization=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- at a lower priority, in a child process --------------------------------------


def _child(results, niceness: int, args: tuple, kwargs: dict) -> None:
    os.nice(niceness)
    try:
        results.put(("ok", fine_tune(*args, **kwargs)))
    except BaseException as e:  # the parent re-raises it
        results.put(("error", f"{type(e).__name__}: {e}"))


def run_in_subprocess(src_folder: str | Path, examples: Sequence, out_folder: str | Path, *,
                      minutes: float, threads: int | None, lr: float,
                      max_steps: int | None = None, seed: int = 0,
                      niceness: int = 10) -> TrainResult:
    """`fine_tune` in a spawned child process at `os.nice(niceness)`; blocks until
    it is done (call it from a thread where that matters). A failure in the
    child is raised here as a RuntimeError with its message."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    kwargs = dict(minutes=minutes, threads=threads, lr=lr, max_steps=max_steps, seed=seed)
    examples = [tuple(map(list, _pair(e))) for e in examples]  # plain lists pickle anywhere
    child = ctx.Process(target=_child, args=(results, niceness, (str(src_folder), examples,
                                                                 str(out_folder)), kwargs),
                        daemon=True)
    child.start()
    try:
        while True:
            try:
                kind, value = results.get(timeout=1.0)
                break
            except queue_module.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"the fine-tuning process exited with code "
                                       f"{child.exitcode} and no result") from None
    finally:
        child.join(timeout=60)
    if kind == "error":
        raise RuntimeError(f"fine-tuning failed: {value}")
    return value


def _pair(example) -> tuple:
    if hasattr(example, "continuation"):
        return example.context, example.continuation
    return example
