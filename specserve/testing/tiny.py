"""Tiny seeded Llama models and a byte-level tokenizer, built locally for tests.

No model hub is reachable, so tests make their own models: a byte-level BPE
tokenizer with no merges (one token per UTF-8 byte, plus <unk> <s> </s>) and a
2-layer Llama with head dim 64 (the CPU attention refuses smaller heads).
Weights come from a seed, so a test can ask for "the target", "a slightly
perturbed copy of the target" or "an unrelated model" and get the same bytes
every time. Logits are made peaky (large output-layer init) so that greedy
decoding has clear margins and numerics of different kernels agree.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>"]
N_TOKENIZER = 259  # 3 specials + 256 bytes
MODEL_VOCAB = 320  # padded like real checkpoints


def build_tokenizer(path: Path | str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    # A minimal chat template, so the chat endpoint can be tested too.
    fast.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    fast.save_pretrained(str(path))


def build_model(
    path: Path | str,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    perturb_from: Path | str | None = None,
    noise: float = 0.0,
    max_len: int = 1024,
    vocab_size: int = MODEL_VOCAB,
) -> Path:
    """Write a seeded tiny Llama (config, safetensors, tokenizer) to `path`.

    With `perturb_from`, start from that model's weights and add Gaussian noise
    of `noise` times each tensor's standard deviation (a "slightly different"
    draft whose greedy choices mostly agree with the original).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if perturb_from is not None:
        model = LlamaForCausalLM.from_pretrained(str(perturb_from), torch_dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    else:
        model = LlamaForCausalLM(config).to(torch.float32)
        with torch.no_grad():
            # Peaky logits: clear greedy margins, a distribution with structure.
            model.lm_head.weight.normal_(0.0, 0.35)
            model.model.embed_tokens.weight.normal_(0.0, 1.0)
            # Ids past the tokenizer (padding rows) and <unk>/<s> get logit 0,
            # far below the best real token: outputs decode to the same text in
            # vLLM and transformers.
            model.lm_head.weight[N_TOKENIZER:] = 0.0
            model.lm_head.weight[:2] = 0.0
    model.generation_config.do_sample = False
    model.save_pretrained(str(path), safe_serialization=True)
    build_tokenizer(path)
    return path


def greedy_reference(model_dir: Path | str, prompts: list[str], max_tokens: int,
                     ignore_eos: bool = True) -> list[list[int]]:
    """Target-only greedy token ids from Hugging Face transformers (the oracle)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return greedy_ids_for(model_dir, ids, max_tokens,
                          eos_token_id=None if ignore_eos else tok.eos_token_id)


def greedy_ids_for(model_dir: Path | str, prompts_ids: list[list[int]], max_tokens: int,
                   eos_token_id: int | None = None) -> list[list[int]]:
    """Greedy continuation of tokenized prompts, one at a time, with a KV cache."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for ids in prompts_ids:
        gen: list[int] = []
        past, x = None, torch.tensor([list(ids)])
        with torch.no_grad():
            for _ in range(max_tokens):
                res = model(input_ids=x, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
                gen.append(nxt)
                if nxt == eos_token_id:
                    break
                x = torch.tensor([[nxt]])
        out.append(gen)
    return out
