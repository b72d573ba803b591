"""The draft model itself: built from target layers, evaluated, written, assembled.

Owns building the torch draft from N target layers with the target's frozen
embedding (`build_draft`, what stays frozen: `freeze_shared`), its logits and held-out greedy agreement
(`evaluate_alpha`) and recovery hit rate of branches (`evaluate_recovery_hit`), writing it as a normal Hugging Face folder
(`export_draft`) and as the trained tensors alone (`draft-layers.safetensors`),
which `assemble_draft` turns back into a folder given the target (how the
shipped default draft is loaded, see specserve.models.ensure_default_draft).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from specserve.tools.distill.recipe import DistillError, greedy_agreement, recovery_hits
from specserve.tools.distill.state import LAYERS_FILE, SHARED_TENSORS, STATE_FILE

# ---- the draft model (torch) -----------------------------------------------------


def build_draft(target: str | Path, layers: list[int]):
    """A Llama with the target's `layers`, final norm and tied embedding (float32).

    Returns (model, trainable parameter names). The embedding (= output layer)
    is frozen: it is the target's and is not stored with the draft.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src = full.state_dict()
    dst = {}
    for j, i in enumerate(layers):
        for name, tensor in src.items():
            prefix = f"model.layers.{i}."
            if name.startswith(prefix):
                dst[f"model.layers.{j}." + name[len(prefix):]] = tensor
    dst["model.norm.weight"] = src["model.norm.weight"]
    for name in SHARED_TENSORS:
        if name in src:
            dst[name] = src[name]
    missing, unexpected = draft.load_state_dict(dst, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise DistillError(f"cannot build the draft: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        draft.tie_weights()
    del full
    return draft, freeze_shared(draft)


def freeze_shared(model) -> list[str]:
    """Freeze what a draft shares with its target (the embedding, and the output
    layer, tied or not); return the names of the parameters left to train (the
    layers and the final norm). Distillation and online adaptation train the same."""
    model.model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def draft_logits(model, ids, start: int):
    """Draft logits at the positions that predict ids[start:] (n, V)."""
    hidden = model.model(input_ids=ids[None, :-1].long()).last_hidden_state[0, start - 1:]
    return model.lm_head(hidden)


def evaluate_alpha(model, eval_data: list[dict]) -> float:
    """Greedy agreement of `model` with the target's greedy held-out text."""
    import torch

    agree = total = 0
    model.eval()
    with torch.no_grad():
        for s in eval_data:
            ids = s["ids"]
            if len(ids) - s["start"] < 1:
                continue
            pred = draft_logits(model, ids, s["start"]).argmax(-1).tolist()
            a, n = greedy_agreement(pred, ids[s["start"]:].tolist())
            agree += a
            total += n
    model.train()
    return agree / total if total else float("nan")


def evaluate_recovery_hit(model, eval_data: list[dict], fan_outs=(1, 2, 3, 4)) -> dict[int, float]:
    """H at each F on held-out text: the target's token among the draft's F
    next-best tokens, where the draft's greedy token was wrong."""
    import torch

    total = {f: 0 for f in fan_outs}
    misses = 0
    model.eval()
    with torch.no_grad():
        for s in eval_data:
            ids = s["ids"]
            if len(ids) - s["start"] < 1:
                continue
            top = draft_logits(model, ids, s["start"]).topk(max(fan_outs) + 1, dim=-1).indices
            h, m = recovery_hits(top.tolist(), ids[s["start"]:].tolist(), fan_outs)
            misses += m
            for f in fan_outs:
                total[f] += h[f]
    return {f: total[f] / misses if misses else float("nan") for f in fan_outs}


def trained_tensors(model, trainable: list[str]) -> dict:
    params = dict(model.named_parameters())
    return {n: params[n].detach() for n in trainable}


def draft_config(target: str | Path, n_layers: int, layers: list[int]) -> dict:
    """The target's config.json with the draft's layer count (and per-layer lists cut)."""
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = n_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i] for i in layers]
    return config


def export_draft(model, trainable: list[str], target: str | Path, out: Path,
                 layers: list[int]) -> None:
    """Write OUT as a Hugging Face folder (bf16) and the trained tensors alone."""
    import torch
    from safetensors.torch import save_file

    tmp = out / ".export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in trained_tensors(model, trainable).items()},
              str(tmp / LAYERS_FILE), metadata={"layers": json.dumps(model.config.num_hidden_layers)})
    assemble_draft(target, tmp / LAYERS_FILE, tmp,
                   config=draft_config(target, model.config.num_hidden_layers, layers))
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def assemble_draft(target: str | Path, layers_file: Path, dest: Path, config: dict) -> None:
    """A Hugging Face draft folder in `dest`: `config` (a draft config dict), the
    target's tokenizer files and generation config, and model.safetensors =
    the trained tensors of `layers_file` + the target's embedding (and output
    layer, if the target does not tie them)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    target = Path(target)
    tensors = load_file(str(layers_file))
    dtype = next(iter(tensors.values())).dtype
    for shard in sorted(target.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in SHARED_TENSORS:
                if name in f.keys():
                    tensors[name] = f.get_tensor(name).to(dtype)
    if "model.embed_tokens.weight" not in tensors:
        raise DistillError(f"target {target} has no model.embed_tokens.weight in its safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    config = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    config["architectures"] = ["LlamaForCausalLM"]
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in target.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in (
                "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                "vocab.json", "merges.txt")):
            shutil.copyfile(f, dest / f.name)


def ship(out: Path, dest: Path) -> None:
    """Copy what a shipped draft needs from OUT into `dest`: the trained tensors,
    the draft config and the run's record (distill.json). No embedding."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (LAYERS_FILE, "config.json", STATE_FILE):
        shutil.copyfile(out / name, dest / name)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
