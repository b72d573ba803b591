"""What each replica of a pool is given: how many there are, Ray's share, vLLM's settings.

Owns `Autoscaling` (a pool's replica count bounds: min, max, initial, the
delays), `Resources` (what Ray reserves for each worker of a replica: CPUs,
GPUs, accelerator type, memory, environment) and `EngineConfig` (the vLLM engine
settings of one replica), with their checks. The target and draft pools
(specserve/config/pools.py) and the router (specserve/config/schema.py) are
made of them; whether a local cluster can hold them is specserve/config/fit.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from specserve.config.base import _require_non_empty, _Strict


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
