"""The output folder of `specserve distill` and what it records.

Owns the layout of OUT (the Hugging Face draft, `distill.json` with the
settings, data sizes, alpha before/after and history, `data/` shards,
`checkpoint.pt`), `DistillState` (so a run resumes), checking the target and
opening OUT (new, empty, or the same run to resume; anything else refused).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve.tools.distill.recipe import DistillError, select_layers

STATE_FILE = "distill.json"
LAYERS_FILE = "draft-layers.safetensors"
CHECKPOINT_FILE = "checkpoint.pt"
DATA_DIR = "data"
EVAL_FILE = "eval.pt"
DATA_STATE_FILE = "data.json"
DATA_FIELDS = ("data_rounds", "train_sequences", "train_tokens", "eval_sequences",
               "eval_tokens", "data_seconds")
# Taken from the target when the draft is assembled, never stored with it
# (lm_head only exists separately in targets that do not tie it to the embedding).
SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


# ---- settings and state ----------------------------------------------------------


@dataclass
class DistillState:
    """What `distill.json` records; a folder with it is a previous run to resume."""

    target: str
    target_layers: int
    layers: list[int]
    top_k: int
    seed: int
    data_rounds: int = 0
    train_sequences: int = 0
    train_tokens: int = 0
    eval_sequences: int = 0
    eval_tokens: int = 0
    data_seconds: float = 0.0
    steps: int = 0
    tokens_trained: int = 0
    train_seconds: float = 0.0
    alpha_before: float | None = None
    alpha_after: float | None = None
    target_alpha: float | None = None
    history: list[dict] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)

    def save(self, out: Path) -> None:
        """Write distill.json, with the data figures as the data generator last wrote them."""
        self.refresh_data(out)
        if (out / STATE_FILE).is_file():
            # Keep commands another run (e.g. a data run) recorded meanwhile.
            on_disk = json.loads((out / STATE_FILE).read_text()).get("commands", [])
            self.commands = [c for c in on_disk if c not in self.commands] + self.commands
        _write_json(out / STATE_FILE, asdict(self))

    def save_data(self, out: Path) -> None:
        """Write the data figures alone (data/data.json): a data run and a training
        run may share OUT, and neither must overwrite the other's figures."""
        _write_json(out / DATA_DIR / DATA_STATE_FILE, {k: getattr(self, k) for k in DATA_FIELDS})

    def refresh_data(self, out: Path) -> None:
        path = out / DATA_DIR / DATA_STATE_FILE
        if path.is_file():
            for key, value in json.loads(path.read_text()).items():
                setattr(self, key, value)

    @classmethod
    def load(cls, out: Path) -> DistillState:
        state = cls(**json.loads((out / STATE_FILE).read_text()))
        state.refresh_data(out)
        return state


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def check_target(target: str | Path) -> Path:
    """The target folder, or a DistillError that says what is wrong."""
    path = Path(target)
    if not path.is_dir():
        raise DistillError(f"target model folder {target} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise DistillError(f"target model folder {target} has no config.json; "
                           "pass a Hugging Face model folder")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "llama":
        raise DistillError(f"target {target} is a {config.get('model_type')!r} model; "
                           "distill supports Llama-architecture targets (e.g. SmolLM2)")
    return path.resolve()


def open_out(out: str | Path, target: Path, n_layers: int, top_k: int, seed: int) -> DistillState:
    """Create OUT, or resume the previous run in it; refuse anything else."""
    from transformers import AutoConfig

    out = Path(out)
    config = AutoConfig.from_pretrained(target)
    layers = select_layers(config.num_hidden_layers, n_layers)
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {out} is a file; pass a new folder")
    if out.is_dir() and (out / STATE_FILE).is_file():
        state = DistillState.load(out)
        if (state.target, state.layers, state.top_k) != (str(target), layers, top_k):
            raise DistillError(
                f"--out {out} holds a distillation of {state.target} with layers {state.layers} "
                f"and top-{state.top_k}, not of {target} with layers {layers} and top-{top_k}; "
                "pass the same settings to resume, or a new folder")
        return state
    if out.is_dir() and any(out.iterdir()):
        raise DistillError(f"--out {out} exists and is not a previous distill run (no "
                           f"{STATE_FILE}); pass a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    state = DistillState(target=str(target), target_layers=config.num_hidden_layers,
                         layers=layers, top_k=top_k, seed=seed)
    state.save(out)
    return state


def log(message: str) -> None:
    print(f"specserve distill: {message}", file=sys.stderr, flush=True)
