"""The pools of a deployment: the target pool and the draft pools.

Owns `TargetConfig` (the replicas that verify drafts and serve the API's model:
model folder, served name, tensor parallelism over hosts, the sink port, the
tool call parser) and `DraftConfig` (one draft pool: its name, its kind, model,
suffix memory or both, and its online adaptation), each with its replica bounds,
resources and engine settings (specserve/config/replicas.py) and the checks
that tie its fields together (TP on GPUs, hosts dividing TP, a model for kinds
model and hybrid and none for suffix). Checks across pools (unique draft names)
are `AppConfig`'s (specserve/config/schema.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from specserve.config.adapt import AdaptConfig
from specserve.config.base import _require_non_empty, _Strict
from specserve.config.naming import DRAFT_NAME_MAX_LEN, DRAFT_NAME_RE
from specserve.config.replicas import Autoscaling, EngineConfig, Resources
from specserve.config.suffix import SuffixConfig
from specserve.models import DEFAULT_MODEL_NAME


class TargetConfig(_Strict):
    """The target pool: replicas that verify drafts and serve the API's model."""

    model: str | None = Field(
        None,
        description="Hugging Face model folder of the target. Null: the embedded default "
                    f"model ({DEFAULT_MODEL_NAME}), converted into the local cache on first use.")
    name: str | None = Field(
        None,
        description="Model name served by the OpenAI API. Null: the model folder's name "
                    f"(or {DEFAULT_MODEL_NAME} for the default model).")
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="Tensor-parallel workers per target replica (TP); each gets one "
                    "placement-group bundle of `resources`.")
    hosts: int = Field(
        1, ge=1,
        description="Nodes one target replica spans, for a target larger than one node "
                    "(GPUs only): its tensor_parallel_size workers split evenly over them, "
                    "placed with Ray's PACK strategy (as Ray Serve LLM does); in the chart, "
                    "the target group's numOfHosts. 1: the replica stays on one node "
                    "(STRICT_PACK).")
    replicas: Autoscaling = Field(
        default_factory=Autoscaling, description="Replica count bounds of the target pool.")
    resources: Resources = Field(
        default_factory=Resources, description="Ray resources per tensor-parallel worker.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="vLLM engine settings of each target replica.")
    sink_port: int = Field(
        0, ge=0, le=65535,
        description="Port of each target replica's draft sink (gRPC, drafts stream tokens "
                    "to it). 0: any free port.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Most requests Ray Serve sends to one target replica at a time.")
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's parser of the model's tool calls (e.g. 'hermes', 'llama3_json', "
                    "'pythonic'; as `vllm serve --enable-auto-tool-choice --tool-call-parser "
                    "NAME`), for chat requests with `tools`. Null: a request whose "
                    "tool_choice is not 'none' gets a 400 naming this field.")

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, v):
        return _require_non_empty(v, "model")

    @field_validator("name")
    @classmethod
    def _name_not_empty(cls, v):
        return _require_non_empty(v, "name")

    @field_validator("tool_call_parser")
    @classmethod
    def _parser_not_empty(cls, v):
        return _require_non_empty(v, "tool_call_parser")

    @model_validator(mode="after")
    def _check(self):
        gpus = self.resources.gpus_per_worker
        if self.tensor_parallel_size > 1 and gpus > 0 and gpus != 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} on GPUs needs "
                             f"resources.gpus_per_worker: 1 (got {gpus}): each tensor-parallel "
                             "worker drives exactly one GPU")
        if self.hosts > 1 and gpus <= 0:
            raise ValueError(f"hosts {self.hosts} needs GPUs (resources.gpus_per_worker > 0): "
                             "a CPU target runs its workers as local processes, on one node")
        if self.tensor_parallel_size % self.hosts:
            raise ValueError(f"hosts {self.hosts} does not divide tensor_parallel_size "
                             f"{self.tensor_parallel_size}: each node runs the same number of "
                             "tensor-parallel workers")
        return self

    def served_name(self) -> str:
        """The model name the OpenAI API serves."""
        if self.name is not None:
            return self.name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        return Path(self.model).name or self.model


class DraftConfig(_Strict):
    """One draft pool: replicas that stream drafts to targets, each running a small
    model (kind model), a suffix memory and no model (kind suffix), or both (kind
    hybrid)."""

    name: str = Field(
        ...,
        description="Unique name of the pool: lowercase letters, digits and '-', at most "
                    f"{DRAFT_NAME_MAX_LEN} characters; suffix of its Serve deployment name.")
    kind: Literal["model", "suffix", "hybrid"] = Field(
        "model", description="model: replicas run a draft model (vLLM). suffix: replicas run "
                             "no model and draft from the tokens earlier requests and this "
                             "one continued with (SuffixDecoding; settings in suffix). "
                             "hybrid: replicas run the draft model and keep a suffix memory "
                             "beside it; at each position the memory's draft is sent where "
                             "it scores above the model's measured acceptance.")
    model: str | None = Field(
        None, description="Hugging Face model folder of the draft (kinds model and hybrid, "
                          "required there); it must use the target's tokenizer (checked where the "
                          "models are). 'default': the draft distilled from the default "
                          "model that ships with specserve, assembled into the local cache on "
                          "first use. Null with kind suffix.")
    suffix: SuffixConfig = Field(
        default_factory=SuffixConfig, description="The suffix memory (kinds suffix and "
                                                  "hybrid).")
    replicas: Autoscaling = Field(
        default_factory=Autoscaling, description="Replica count bounds of this draft pool.")
    resources: Resources = Field(
        default_factory=Resources, description="Ray resources per draft replica.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="vLLM engine settings of each draft replica.")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Most requests Ray Serve sends to one draft replica at a time.")
    adapt: AdaptConfig = Field(
        default_factory=AdaptConfig,
        description="Online adaptation to the traffic the pool serves (kinds model and "
                    "hybrid; off by default): what each replica collects of the verified "
                    "tokens, the guard, the schedule, the weight versions.")

    @field_validator("name")
    @classmethod
    def _name_format(cls, v: str):
        if len(v) > DRAFT_NAME_MAX_LEN or not DRAFT_NAME_RE.fullmatch(v):
            raise ValueError(f"draft name {v!r} must be lowercase letters, digits and single "
                             f"'-' between them, at most {DRAFT_NAME_MAX_LEN} characters "
                             "(e.g. 'llama-1b')")
        return v

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, v):
        if v is not None and not v.strip():
            raise ValueError("model must be a model folder path, got an empty string")
        return v

    @model_validator(mode="after")
    def _kind_fits(self):
        if self.kind != "suffix" and self.model is None:
            raise ValueError(f"model: a draft pool of kind {self.kind} needs a model folder "
                             "(or 'default'); set kind: suffix for a pool without a model")
        if self.kind == "suffix" and self.model is not None:
            raise ValueError(f"model: a suffix pool runs no model, got {self.model!r}; "
                             "remove model or set kind: model")
        if self.kind == "suffix" and self.adapt.enabled:
            raise ValueError("adapt.enabled: a suffix pool has no draft model to train; "
                             "remove adapt or set kind: model (or hybrid)")
        return self

    @property
    def draft_spec(self) -> str:
        """What DraftWorker.start takes: the model folder, 'suffix', or hybrid:FOLDER."""
        if self.kind == "suffix":
            return "suffix"
        return f"hybrid:{self.model}" if self.kind == "hybrid" else self.model

    @property
    def has_model(self) -> bool:
        """Its replicas run a draft model (kinds model and hybrid)."""
        return self.kind != "suffix"
