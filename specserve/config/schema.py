"""The schema of a specserve deployment: one pydantic model, one source of truth.

Owns `AppConfig` and its parts (the target pool, the draft pools and their
online adaptation, speculation settings K and W, the HTTP ingress, the quotas,
replica routing, how to reach Ray, gRPC TLS: the sections with modules of
their own are imported). Every field
carries a `description=`: that text is the reference documentation of every key
in `cluster/*.yaml` and of the Helm values, which are generated from this model.
Owns the cross-field checks that must fail at load time, before anything starts
(min <= initial <= max replicas, W > K, unique draft names, ...), and deriving a
config from another (`with_overrides`: the CLI's flags). Reading files and
formatting errors is `specserve.config.loading`; draft pool names are
`specserve.config.naming`.

It does not check that model folders exist or that a draft's tokenizer matches
the target's: a config is often written on one machine for models that live on
others (e.g. `/models/...` inside the cluster). The CLI and the replicas check
those where the models are.

Every model forbids unknown keys (`extra="forbid"`), so a typo such as
`max_replica: 4` is an error instead of a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from specserve.config.adapt import AdaptConfig
from specserve.config.base import _require_non_empty, _Strict
from specserve.config.loading import (DEFAULT_CONFIG_PATH, MODEL_DRAFT_CONFIG_PATH, ConfigError,
                                      read_yaml, validation_error)
from specserve.config.grpc_tls import GrpcTlsConfig
from specserve.config.http import HttpConfig
from specserve.config.naming import DRAFT_NAME_MAX_LEN, DRAFT_NAME_RE, pool_names
from specserve.config.quotas import QuotaConfig
from specserve.config.routing import RoutingConfig
from specserve.config.speculation import SpeculationConfig
from specserve.config.suffix import SuffixConfig
from specserve.models import DEFAULT_DRAFT_KEYWORD, DEFAULT_MODEL_NAME

# Engine settings that describe one model rather than the machine (its context
# length): a value the embedded default sets for the default model must not be
# applied to another model that replaces it (`with_overrides`).
MODEL_BOUND_ENGINE_KEYS = ("max_model_len",)


class Resources(_Strict):
    """What Ray reserves for each worker of a replica."""

    cpus_per_worker: float = Field(
        1.0, ge=0,
        description="CPUs Ray reserves per worker: per tensor-parallel worker for a target "
                    "(one placement-group bundle each), per replica for a draft.")
    gpus_per_worker: float = Field(
        0.0, ge=0,
        description="GPUs Ray reserves per worker (0 on CPU machines). Fractions below 1 "
                    "share a GPU; above 1 it must be a whole number (a Ray rule).")
    accelerator_type: str | None = Field(
        None,
        description="Ray accelerator type the worker must run on, e.g. 'H100' for targets "
                    "or 'L4' for drafts (Ray's accelerator_type option). Null: any.")
    memory_gib: float | None = Field(
        None, gt=0,
        description="Host memory Ray reserves per worker, GiB. Null: no reservation.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables for the replica's processes, e.g. "
                    "VLLM_CPU_OMP_THREADS_BIND. Values are strings (numbers are converted).")

    @field_validator("accelerator_type")
    @classmethod
    def _accelerator_not_empty(cls, v):
        return _require_non_empty(v, "accelerator_type")

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_to_str(cls, v):
        # YAML reads `VLLM_CPU_OMP_THREADS_BIND: 0` as an int; environment values
        # are strings, so accept numbers as written. Booleans are not converted:
        # YAML turns yes/no/on/off into them, and which spelling the program
        # expects is anyone's guess, so make the author quote it.
        if isinstance(v, dict):
            return {k: str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x
                    for k, x in v.items()}
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]):
        for name in v:
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"environment variable name {name!r} is not valid; "
                                 "use a name without '=' (e.g. VLLM_CPU_OMP_THREADS_BIND)")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.gpus_per_worker > 1 and not float(self.gpus_per_worker).is_integer():
            raise ValueError(f"gpus_per_worker ({self.gpus_per_worker}) above 1 must be a whole "
                             "number (Ray only splits single GPUs); use e.g. 1 or 2")
        if self.accelerator_type is not None and self.gpus_per_worker == 0:
            raise ValueError(f"accelerator_type ({self.accelerator_type!r}) needs "
                             "gpus_per_worker > 0; set gpus_per_worker or remove accelerator_type")
        return self


class Autoscaling(_Strict):
    """Replica count bounds of a pool (Ray Serve autoscaling)."""

    min_replicas: int = Field(
        1, ge=0, description="Fewest replicas the pool scales down to (0 allows scale to zero).")
    max_replicas: int = Field(
        1, ge=1, description="Most replicas the pool scales up to; >= min_replicas.")
    initial_replicas: int | None = Field(
        None, ge=0,
        description="Replicas started at deploy time, between min_replicas and max_replicas. "
                    "Null: min_replicas.")
    upscale_delay_s: float = Field(
        30.0, ge=0, description="Seconds the load must stay high before adding replicas.")
    downscale_delay_s: float = Field(
        300.0, ge=0, description="Seconds the load must stay low before removing replicas.")

    @model_validator(mode="after")
    def _check(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is greater than max_replicas "
                             f"({self.max_replicas}); raise max_replicas or lower min_replicas")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError(f"initial_replicas ({self.initial_replicas}) must be between "
                             f"min_replicas ({self.min_replicas}) and max_replicas "
                             f"({self.max_replicas})")
        return self


class EngineConfig(_Strict):
    """vLLM engine settings of one replica."""

    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt + output) in tokens. Null: the model's.")
    max_num_seqs: int = Field(
        64, ge=1, description="Most sequences the engine batches in one step.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype. 'auto': vLLM's choice for the model.")
    seed: int = Field(
        0, ge=0, description="Engine seed for sampling at temperature > 0.")
    kv_cache_gib: int | None = Field(
        None, ge=1,
        description="KV cache size in GiB, CPU engines only (VLLM_CPU_KVCACHE_SPACE). "
                    "Null: VLLM_CPU_KVCACHE_SPACE or vLLM's default. Ignored on GPU.")
    enforce_eager: bool = Field(
        True, description="Run without CUDA graphs / compilation: slower steps, faster start.")


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


class RayConfig(_Strict):
    """Which Ray cluster to run on."""

    address: str | None = Field(
        None,
        description="Ray cluster address, e.g. 'auto' or 'ray://head:10001'. Null: start a "
                    "local cluster, unless RAY_ADDRESS is set.")
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local cluster started by specserve. Null: all.")

    @model_validator(mode="after")
    def _check(self):
        # Ray treats address "local" as "start a local cluster" too.
        if self.num_cpus is not None and self.address not in (None, "local"):
            raise ValueError(f"num_cpus only sizes a local cluster, but address is "
                             f"{self.address!r}; remove num_cpus or address")
        return self


class RouterConfig(_Strict):
    """The router deployment (the HTTP ingress): its replicas and where they run."""

    replicas: Autoscaling = Field(
        default_factory=Autoscaling,
        description="Router replica bounds; min < max autoscales on requests in flight "
                    "(Serve's own policy, target_ongoing_requests per replica).")
    target_ongoing_requests: int = Field(
        256, ge=1, description="Requests in flight per router replica that Serve's "
                               "autoscaling aims for (when min_replicas < max_replicas).")
    ray_resource: str | None = Field(
        None, min_length=1,
        description="A Ray custom resource each router replica asks one unit of, so that it "
                    "runs only on nodes that advertise it (the Helm chart's router pods, or "
                    "the head), the only ones that need the API key. Null: any node.")


class AppConfig(_Strict):
    """A whole specserve deployment."""

    target: TargetConfig = Field(
        default_factory=TargetConfig, description="The target pool.")
    drafts: list[DraftConfig] = Field(
        default_factory=list, description="Draft pools, one per draft model. Empty: target-only.")
    speculation: SpeculationConfig = Field(
        default_factory=SpeculationConfig, description="K and W.")
    http: HttpConfig = Field(
        default_factory=HttpConfig, description="HTTP ingress.")
    quotas: QuotaConfig = Field(
        default_factory=QuotaConfig,
        description="Per-request limits (n, prompt and completion tokens), the queue in "
                    "front of the target pool, the request timeout.")
    router: RouterConfig = Field(
        default_factory=RouterConfig, description="The router deployment (HTTP ingress).")
    ray: RayConfig = Field(
        default_factory=RayConfig, description="Ray cluster.")
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="Replica choice: by prefix within a load bound, or Ray Serve's default.")
    grpc_tls: GrpcTlsConfig | None = Field(
        None, description="Mutual TLS on the draft -> target gRPC stream. Null: plaintext "
                          "(fine on a private network or loopback).")

    @model_validator(mode="after")
    def _check(self):
        # These errors have no single field location pydantic can attach, so
        # each message starts with the path it is about.
        seen: dict[str, int] = {}
        for i, d in enumerate(self.drafts):
            if d.name in seen:
                raise ValueError(f"drafts[{i}].name: {d.name!r} is already the name of "
                                 f"drafts[{seen[d.name]}]; draft names must be unique")
            seen[d.name] = i
        if self.drafts and self.speculation.num_speculative_tokens == 0:
            raise ValueError("speculation.num_speculative_tokens: 0 with drafts configured; "
                             "set it to 1 or more, or remove the drafts to run target-only")
        return self

    # ---- loading -------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> AppConfig:
        """Validate parsed data; `source` names it in errors (a path, "command line")."""
        if data is None:  # an empty YAML file: all defaults
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of keys "
                              f"(target, drafts, ...), got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e, cls, source) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        return cls.from_dict(read_yaml(path), source=str(path))

    @classmethod
    def embedded_default(cls, model_draft: bool = False) -> AppConfig:
        """The CPU default (`cluster/default.yaml` of the repo: a suffix draft);
        model_draft: its pair with a draft model (`cluster/model-draft.yaml`)."""
        path = MODEL_DRAFT_CONFIG_PATH if model_draft else DEFAULT_CONFIG_PATH
        if not path.is_file():
            raise ConfigError(f"the default config {path} is missing: specserve "
                              "must be installed from its repository (pip install -e .), "
                              "or pass a config file")
        return cls.from_yaml(path)

    # ---- deriving ------------------------------------------------------------

    def with_overrides(self, target: str | None = None, drafts: list[str] | None = None,
                       port: int | None = None, api_key: str | None = None,
                       api_key_file: str | None = None,
                       share_draft_cpus: bool = False, host: str | None = None) -> AppConfig:
        """A new config with the CLI's flags applied; None leaves a setting as it is.

        target: the target model folder. The served name is reset to follow
          the new folder, since a name set for another model would mislead.
        drafts: draft model folders (`--draft PATH`, repeatable); they replace
          the configured pools. Each pool is named from its folder (sanitized,
          -2, -3, ... for repeats) and copies replicas, resources, engine and
          max_ongoing_requests from the first configured draft model pool (or
          defaults; a suffix pool's settings do not fit a model).
          An empty list means no drafts (target-only).
        share_draft_cpus: the new pools split the first pool's
          resources.cpus_per_worker between them instead of each copying it
          (what a local cluster sized for one draft pool needs).

        A model that replaces the default model (target `model: null`, draft
        `model: default`) does not inherit the engine settings that describe
        the default model (`MODEL_BOUND_ENGINE_KEYS`, e.g. max_model_len): they
        become null, the new model's own.
        """
        data = self.model_dump()
        if target is not None:
            if self.target.model is None:
                _reset_model_bound(data["target"]["engine"])
            data["target"]["model"] = target
            data["target"]["name"] = None
        if drafts is not None:
            first = next((d for d in self.drafts if d.kind == "model"), None)
            template = first.model_dump() if first else {}
            pools = []
            for path, name in zip(drafts, pool_names(drafts)):
                pool = {k: v for k, v in template.items() if k not in ("name", "model")}
                if share_draft_cpus and "resources" in pool:
                    pool["resources"] = {**pool["resources"], "cpus_per_worker":
                                         pool["resources"]["cpus_per_worker"] / len(drafts)}
                if first is not None and first.model == DEFAULT_DRAFT_KEYWORD \
                        and path != DEFAULT_DRAFT_KEYWORD:
                    pool["engine"] = dict(pool["engine"])
                    _reset_model_bound(pool["engine"])
                pools.append({**pool, "name": name, "model": path})
            data["drafts"] = pools
        if port is not None:
            data["http"]["port"] = port
        if host is not None:
            data["http"]["host"] = host
        if api_key is not None or api_key_file is not None:
            # The flag's key replaces the config's source of keys.
            data["http"].update(api_key=api_key, api_key_env=None,
                                api_key_file=None if api_key_file is None
                                else str(Path(api_key_file).resolve()))
        # Validate again: an override can break a cross-field rule (e.g. drafts
        # added to a K=0 config).
        return AppConfig.from_dict(data, source="command line")

    def draft_kinds(self) -> dict[str, str]:
        """Each draft pool's kind ("model", "suffix" or "hybrid") by pool name: the one map
        the router, its views and the K choice read a pool's kind from."""
        return {d.name: d.kind for d in self.drafts}

    def lookahead_tokens(self) -> int:
        """The effective W (lookahead, or 2K + 1 when unset)."""
        return self.speculation.lookahead_tokens()

    def to_yaml(self) -> str:
        """YAML that `from_yaml` reads back into an equal config (all keys, nulls included)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _reset_model_bound(engine: dict) -> None:
    for key in MODEL_BOUND_ENGINE_KEYS:
        engine[key] = None
