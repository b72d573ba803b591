"""Held-out alpha of a draft on examples of the traffic it serves.

Owns `heldout_alpha`: the share of continuation positions where the draft's
greedy next token, teacher-forced on the context and the continuation so far,
equals the token the target verified there (the same greedy agreement as
`specserve distill`'s alpha, `recipe.greedy_agreement`). Also the batching
both evaluation and fine-tuning use: an example as (context, continuation)
ids (`example_ids`), padded batches of examples bounded in tokens
(`batches`), and the draft's logits at the continuation positions of a batch
with the target's tokens there (`continuation_logits`); and bounding torch's
threads (`torch_threads`).

An example is a buffer `Example` (`.context`, `.continuation`) or a pair of
id lists. Never trains, never writes a file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from specserve.tools.distill.recipe import greedy_agreement

# A longer context is cut to its last CONTEXT_TOKENS: bounds the memory of a
# batch; the positions that matter are the continuation's.
CONTEXT_TOKENS = 1024
# Padded tokens (rows x longest row) per forward pass.
BATCH_TOKENS = 2048
# Rows of hidden states sent through the output layer at once: the logits of a
# 49k-token vocabulary are 200 KB a row in float32.
LOGIT_ROWS = 512


def example_ids(example) -> tuple[list[int], list[int]]:
    """(context, continuation) ids of a buffer Example or a (context, continuation) pair.

    The first continuation token needs a context to be predicted from: with an
    empty context it becomes the context (and is not counted).
    """
    if hasattr(example, "continuation"):
        context, continuation = example.context, example.continuation
    else:
        context, continuation = example
    context, continuation = list(context)[-CONTEXT_TOKENS:], list(continuation)
    if not context and continuation:
        context, continuation = continuation[:1], continuation[1:]
    return context, continuation


def positions(examples: Iterable) -> int:
    """Continuation positions the examples hold (what alpha and training count)."""
    return sum(len(example_ids(e)[1]) for e in examples)


def batches(examples: Sequence, batch_tokens: int = BATCH_TOKENS) -> Iterator[list]:
    """Consecutive groups of examples whose padded size (rows x longest) stays
    within `batch_tokens` (a longer example is a batch alone). Examples
    without continuation positions are skipped."""
    batch: list = []
    longest = 0
    for e in examples:
        context, continuation = example_ids(e)
        if not continuation:
            continue
        n = len(context) + len(continuation) - 1
        if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(e)
        longest = max(longest, n)
    if batch:
        yield batch


def continuation_hidden(model, batch: Sequence):
    """The draft's last hidden states at the continuation positions of `batch`
    (n, H) and the target's tokens there (n,), rows in example order.

    One right-padded forward pass: the row of an example is context +
    continuation minus its last token; position p predicts token p + 1.
    """
    import torch

    rows = [example_ids(e) for e in batch]
    width = max(len(c) + len(t) - 1 for c, t in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    targets = []
    for r, (context, continuation) in enumerate(rows):
        row = context + continuation[:-1]
        ids[r, :len(row)] = torch.tensor(row)
        attention[r, :len(row)] = 1
        scored[r, len(context) - 1:len(row)] = True
        targets.extend(continuation)
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    return hidden[scored], torch.tensor(targets, dtype=torch.long)


def continuation_logits(model, batch: Sequence):
    """The draft's logits at the continuation positions of `batch` (n, V) and
    the target's tokens there (n,)."""
    hidden, targets = continuation_hidden(model, batch)
    return model.lm_head(hidden), targets


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op threads bounded to `threads` inside the block (None: as is)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_draft(folder: str | Path):
    """A Hugging Face causal LM folder as a float32 torch model."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def heldout_alpha(model_folder_or_model, examples: Sequence, *, threads: int | None,
                  batch_tokens: int = BATCH_TOKENS) -> tuple[int, int]:
    """(agreeing positions, positions) of the draft's greedy tokens against the
    target's verified continuations; alpha = agreeing / positions.

    `model_folder_or_model`: a Hugging Face folder (loaded in float32) or a
    loaded causal LM (left in the train/eval mode it was in).
    """
    import torch

    with torch_threads(threads):
        is_folder = isinstance(model_folder_or_model, (str, Path))
        model = load_draft(model_folder_or_model) if is_folder else model_folder_or_model
        was_training = model.training
        model.eval()
        agree = total = 0
        try:
            with torch.no_grad():
                for batch in batches(examples, batch_tokens):
                    hidden, targets = continuation_hidden(model, batch)
                    greedy = torch.cat([model.lm_head(h).argmax(-1)
                                        for h in hidden.split(LOGIT_ROWS)])
                    a, n = greedy_agreement(greedy.tolist(), targets.tolist())
                    agree, total = agree + a, total + n
        finally:
            model.train(was_training)
    return agree, total
