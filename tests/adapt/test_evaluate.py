"""heldout_alpha: 1.0 on the draft's own greedy continuations, low on random ones;
batching and padding change nothing; examples as pairs or buffer-like objects."""

from __future__ import annotations

import random
from types import SimpleNamespace

from adapt_models import VOCAB
from specserve.adapt import evaluate
from specserve.testing.tiny import greedy_ids_for


def _contexts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(count)]


def test_alpha_is_one_on_the_drafts_own_greedy_continuations(tiny_draft):
    contexts = _contexts(12, seed=1)
    own = greedy_ids_for(tiny_draft, contexts, max_tokens=10)
    examples = list(zip(contexts, own))
    assert evaluate.heldout_alpha(tiny_draft, examples, threads=1) == (120, 120)


def test_alpha_is_low_on_random_continuations(tiny_draft):
    rng = random.Random(2)
    examples = [(c, [rng.randrange(3, VOCAB) for _ in range(10)]) for c in _contexts(12, seed=2)]
    agree, total = evaluate.heldout_alpha(tiny_draft, examples, threads=1)
    assert total == 120 and agree / total < 0.2


def test_batching_and_example_shapes_do_not_change_alpha(tiny_draft):
    contexts = _contexts(10, seed=3)
    own = greedy_ids_for(tiny_draft, contexts, max_tokens=8)
    rng = random.Random(3)
    # Half the continuations are the draft's own, half are corrupted after 4 tokens.
    examples = [(c, o if i % 2 else o[:4] + [rng.randrange(3, VOCAB) for _ in range(4)])
                for i, (c, o) in enumerate(zip(contexts, own))]
    together = evaluate.heldout_alpha(tiny_draft, examples, threads=1)
    one_by_one = evaluate.heldout_alpha(tiny_draft, examples, threads=1, batch_tokens=1)
    as_objects = evaluate.heldout_alpha(
        evaluate.load_draft(tiny_draft),
        [SimpleNamespace(context=c, continuation=t) for c, t in examples], threads=1)
    assert together == one_by_one == as_objects
    assert together[1] == 80 and 60 <= together[0] < 80


def test_example_ids_cut_long_contexts_and_lend_an_empty_one_a_token():
    long = list(range(evaluate.CONTEXT_TOKENS + 5))
    assert evaluate.example_ids((long, [7])) == (long[5:], [7])
    assert evaluate.example_ids(([], [4, 5, 6])) == ([4], [5, 6])
    assert evaluate.positions([([], [4, 5, 6]), ([1], []), ([1], [2])]) == 3
    groups = list(evaluate.batches([([1, 2], [3, 4])] * 5 + [([1], [])], batch_tokens=6))
    assert [len(g) for g in groups] == [2, 2, 1]
