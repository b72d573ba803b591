"""Tests for specserve.models: tokenizer compatibility and the default model."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, PreTrainedTokenizerFast

from specserve import models

SPECIALS = ["<unk>", "<s>", "</s>"]


def make_model_dir(path: Path, words: list[str], eos: str = "</s>") -> Path:
    """A folder with a tiny word-level tokenizer and a tiny LlamaConfig (no weights)."""
    tokens = SPECIALS + words
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token=eos
    )
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab[eos],
    )
    config.save_pretrained(path)
    return path


def test_same_tokenizer_is_compatible(tmp_path):
    target = make_model_dir(tmp_path / "target", ["hello", "world"])
    draft = make_model_dir(tmp_path / "draft", ["hello", "world"])
    assert models.tokenizers_compatible(target, draft) is None
    assert models.tokenizers_compatible(target, target) is None


def test_different_vocab_size_names_both_sizes(tmp_path):
    target = make_model_dir(tmp_path / "target", ["a", "b", "c", "d", "e", "f"])  # 9 tokens
    draft = make_model_dir(tmp_path / "draft", ["a", "b"])  # 5 tokens
    message = models.tokenizers_compatible(target, draft)
    assert message is not None
    assert "5" in message and "9" in message
    assert "\n" not in message


def test_same_size_different_tokens(tmp_path):
    target = make_model_dir(tmp_path / "target", ["hello", "world"])
    draft = make_model_dir(tmp_path / "draft", ["bonjour", "monde"])
    message = models.tokenizers_compatible(target, draft)
    assert message is not None
    assert "tokens" in message
    assert "\n" not in message


def test_different_eos_id(tmp_path):
    # Same vocabulary, but the draft would stop at another token.
    target = make_model_dir(tmp_path / "target", ["hello", "world"])
    draft = make_model_dir(tmp_path / "draft", ["hello", "world"], eos="world")
    message = models.tokenizers_compatible(target, draft)
    assert message is not None
    assert "eos_token_id" in message


def test_unloadable_draft_gives_a_message(tmp_path):
    target = make_model_dir(tmp_path / "target", ["hello", "world"])
    message = models.tokenizers_compatible(target, tmp_path / "missing")
    assert message is not None
    assert "draft" in message


def test_default_model_dir_follows_specserve_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert models.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("SPECSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_model_dir() == (
        tmp_path / "home" / ".cache" / "specserve" / "models" / "SmolLM2-135M-Instruct"
    )


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.DefaultModelError, match="make install"):
        models.default_gguf_path()


@pytest.mark.slow
def test_ensure_default_model_converts_once(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    messages = []
    model_dir = models.ensure_default_model(progress=messages.append)

    assert model_dir == tmp_path / "models" / "SmolLM2-135M-Instruct"
    for name in ["config.json", "generation_config.json", "tokenizer.json"]:
        assert (model_dir / name).is_file(), name
    assert (model_dir / "tokenizer_config.json").is_file()
    assert list(model_dir.glob("*.safetensors"))
    assert (model_dir / models.COMPLETE_MARKER).is_file()
    # Nothing temporary is left next to it.
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct.lock",
    ]

    config = AutoConfig.from_pretrained(model_dir)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")

    # A second call finds the marker and converts nothing.
    messages.clear()
    assert models.ensure_default_model(progress=messages.append) == model_dir
    assert messages == []


def test_context_length_as_vllm_derives_it(tmp_path):
    of = models.context_length_of
    assert of({"max_position_embeddings": 512}) == 512
    assert of({"max_position_embeddings": 4096, "max_seq_len": 2048}) == 2048  # the smallest
    assert of({"text_config": {"max_position_embeddings": 300}}) == 300
    assert of({"max_position_embeddings": 4096}, {"model_max_length": 1024}) == 1024
    assert of({"max_position_embeddings": 4096}, {"model_max_length": 10**30}) == 4096
    assert of({"max_position_embeddings": 4096,
               "rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == 16384
    assert of({"max_position_embeddings": 131072,  # already the scaled length
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 131072
    assert of({"max_position_embeddings": 512,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) == 512
    assert of({"hidden_size": 8}) is None  # no key: vLLM decides
    folder = make_model_dir(tmp_path / "m", ["a", "b"])
    assert models.context_length(folder) == json.loads(
        (folder / "config.json").read_text())["max_position_embeddings"]
    assert models.context_length(tmp_path / "nowhere") is None
