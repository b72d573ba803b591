"""A tiny seeded draft for the adaptation tests: a 2-layer Llama, hidden 32,
vocabulary 100, tied embedding (as the shipped draft), float32, in a folder.
The session fixture `tiny_draft` (conftest.py) builds one with it."""

from __future__ import annotations

import random
from pathlib import Path

VOCAB = 100
# A fixed cycle over 24 of the tokens: the "domain" the draft is taught.
CYCLE = random.Random(7).sample(range(3, VOCAB), 24)


def build_tiny_draft(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        # Peaky logits: clear greedy margins, so padded and unpadded passes agree.
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "special_tokens_map.json").write_text("{}\n")  # stands in for tokenizer files
    return path


def pattern_examples(count: int, seed: int, context: int = 6, continuation: int = 12):
    """(context, continuation) pairs that follow CYCLE from random starting points."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randrange(len(CYCLE))
        ids = [CYCLE[(start + i) % len(CYCLE)] for i in range(context + continuation)]
        out.append((ids[:context], ids[context:]))
    return out
