"""fine_tune: a few dozen steps on a fixed pattern take held-out alpha from low to
high; the loss falls; the shared embedding stays frozen; the output folder loads and
the source is untouched; the time bound holds, also in a child process."""

from __future__ import annotations

import hashlib
import math

import pytest

from adapt_models import pattern_examples
from specserve.adapt import train
from specserve.adapt.evaluate import heldout_alpha, load_draft


def _digests(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tuned(tiny_draft, tmp_path_factory):
    before = _digests(tiny_draft)
    out = tmp_path_factory.mktemp("tuned") / "v1"
    result = train.fine_tune(tiny_draft, pattern_examples(48, seed=10), out, minutes=2,
                             threads=1, lr=1e-2, max_steps=40, seed=0, step_tokens=256)
    return out, result, before


def test_training_on_a_pattern_raises_heldout_alpha(tiny_draft, tuned):
    out, result, _ = tuned
    heldout = pattern_examples(16, seed=99)
    agree, total = heldout_alpha(tiny_draft, heldout, threads=1)
    assert agree / total < 0.3
    agree, total = heldout_alpha(out, heldout, threads=1)
    assert agree / total > 0.8
    assert result.steps == 40 and result.tokens >= 40 * 256
    assert math.isfinite(result.loss_first) and result.loss_last < 0.5 * result.loss_first


def test_output_loads_with_frozen_embedding_and_source_unchanged(tiny_draft, tuned):
    out, _, before = tuned
    assert _digests(tiny_draft) == before
    assert (out / "special_tokens_map.json").is_file()
    assert not list(out.parent.glob(".*tmp*"))
    source, tuned_model = load_draft(tiny_draft), load_draft(out)
    src, new = source.state_dict(), tuned_model.state_dict()
    assert new["model.embed_tokens.weight"].equal(src["model.embed_tokens.weight"])
    assert tuned_model.config.tie_word_embeddings
    assert new["lm_head.weight"].equal(new["model.embed_tokens.weight"])
    assert not new["model.layers.0.mlp.up_proj.weight"].equal(src["model.layers.0.mlp.up_proj.weight"])


def test_refuses_an_existing_output_and_empty_examples(tiny_draft, tuned):
    out, _, _ = tuned
    with pytest.raises(FileExistsError, match="never overwritten"):
        train.fine_tune(tiny_draft, pattern_examples(2, seed=1), out, minutes=1, threads=1,
                        lr=1e-3, seed=0)
    with pytest.raises(ValueError, match="no continuation tokens"):
        train.fine_tune(tiny_draft, [([1, 2], [])], out.parent / "v2", minutes=1, threads=1,
                        lr=1e-3, seed=0)


def test_time_bound_holds_in_a_child_process(tiny_draft, tmp_path):
    minutes = 0.05  # 3 s, checked between steps
    result = train.run_in_subprocess(tiny_draft, pattern_examples(48, seed=10), tmp_path / "v1",
                                     minutes=minutes, threads=1, lr=1e-3, seed=0)
    assert result.steps >= 1
    assert result.seconds < minutes * 60 + 3
    assert load_draft(tmp_path / "v1").config.num_hidden_layers == 2
