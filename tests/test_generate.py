"""`specserve generate` end to end: draft worker -> gRPC -> vLLM target.

The invariant under test: greedy output equals Hugging Face transformers'
target-only greedy output, token for token, whatever the draft is.
"""

import re

import pytest

from conftest import PROMPTS, SLOW_TARGET_ENV, run_generate

pytestmark = pytest.mark.slow

SLOW_TARGET = SLOW_TARGET_ENV


def check_outputs(result, reference):
    assert [o["prompt"] for o in result["outputs"]] == PROMPTS
    for out, ref in zip(result["outputs"], reference):
        assert out["token_ids"] == ref, f"output differs from target-only for {out['prompt']!r}"


def check_stats_shape(stats, k=4):
    assert set(stats) == {"draft_tokens", "accepted_tokens", "acceptance_rate",
                          "accepted_per_position", "target_steps", "steps_with_drafts"}
    assert len(stats["accepted_per_position"]) == k
    assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"]
    assert stats["accepted_tokens"] <= stats["draft_tokens"]


def test_draft_equal_to_target(tiny_models, reference):
    result = run_generate(tiny_models["target"], tiny_models["target"], env=SLOW_TARGET)
    check_outputs(result, reference)
    s = result["stats"]
    check_stats_shape(s)
    assert s["acceptance_rate"] >= 0.9, s
    # The pipeline works: drafts are waiting at the target for most steps.
    assert s["steps_with_drafts"] >= 0.5 * s["target_steps"], s
    # ... and most steps take more than one token.
    assert s["target_steps"] < 0.5 * sum(len(o["token_ids"]) for o in result["outputs"])


def test_unrelated_draft(tiny_models, reference):
    result = run_generate(tiny_models["target"], tiny_models["unrelated"], env=SLOW_TARGET)
    check_outputs(result, reference)
    check_stats_shape(result["stats"])
    # The unrelated draft's tokens reached the sink (its log at stream close) ...
    buffered = [int(n) for n in re.findall(r"draft_tokens_buffered=(\d+)", result["_stderr"])]
    assert buffered and max(buffered) > 0
    # ... but after a rejection its first token is for the position the target
    # decides next on its own, and an unrelated draft gets that wrong, so its
    # windows never extend the target's history and are rarely proposed.
    s = result["stats"]
    assert s["draft_tokens"] == 0 or s["acceptance_rate"] < 0.3, s


def test_target_only(tiny_models, reference):
    result = run_generate(tiny_models["target"], "none")
    check_outputs(result, reference)
    assert result["stats"]["draft_tokens"] == 0
    assert result["stats"]["accepted_per_position"] == []


def test_perturbed_draft_on_a_tensor_parallel_2_target(tiny_models, reference):
    result = run_generate(tiny_models["target"], tiny_models["perturbed"], PROMPTS,
                          "--target-tp", "2", env=SLOW_TARGET)
    check_outputs(result, reference)
    s = result["stats"]
    check_stats_shape(s)
    assert 0 < s["accepted_tokens"] < s["draft_tokens"], s  # some accepted, some not


def test_suffix_draft(tiny_models, reference):
    """A draft with no model (`--draft suffix`): it drafts from the prompts and
    the verified output so far (a tiny random model's greedy output loops, so
    it repeats itself); output stays the target's, and some drafts are accepted."""
    result = run_generate(tiny_models["target"], "suffix", env=SLOW_TARGET)
    check_outputs(result, reference)
    s = result["stats"]
    check_stats_shape(s)
    assert 0 < s["accepted_tokens"] <= s["draft_tokens"], s


def test_hybrid_draft(tiny_models, reference):
    """A draft model consulting a suffix memory (`--draft hybrid:FOLDER`), with
    the unrelated model (alone, it is almost never accepted): the memory's
    drafts of the tiny model's looping output are sent where they score above
    the model, and accepted; output stays the target's."""
    result = run_generate(tiny_models["target"], f"hybrid:{tiny_models['unrelated']}",
                          env=SLOW_TARGET)
    check_outputs(result, reference)
    s = result["stats"]
    check_stats_shape(s)
    assert 0 < s["accepted_tokens"] <= s["draft_tokens"], s
    # Both sources drafted (the draft worker's figures at shutdown), and the
    # memory's acceptance, measured from the target's tokens, beats the model's.
    found = re.search(r"sources=\{'memory_drafted': (\d+), 'memory_alpha': ([\d.]+), "
                      r"'model_drafted': (\d+), 'model_alpha': ([\d.]+)\}", result["_stderr"])
    assert found, result["_stderr"][-3000:]
    memory_drafted, memory_alpha, model_drafted, model_alpha = (
        int(found[1]), float(found[2]), int(found[3]), float(found[4]))
    assert memory_drafted > 0 and model_drafted > 0, found[0]
    assert memory_alpha > model_alpha, found[0]
