"""The systems `specserve bench` measures, each behind one small interface.

A backend has `system`, `alpha`, `k`, `start()`, `close()`, `generate(prompt,
params) -> RequestResult`, `counters() -> Counters` (vLLM's engine-wide
spec-decode counters, differenced over a level) and `extra()` (figures only
that system has). Owns starting and stopping each system and timing one
request; never aggregates (that is `report`) or schedules (that is `run`).

- LocalBackend           target_only, specserve_k0, specserve, specserve_synthetic,
                         specserve_suffix (the suffix draft, no model),
                         specserve_hybrid (the draft model with a suffix memory)
                         (a LocalSpec);
- VllmDraftModelBackend  vLLM's co-located speculative_config "draft_model";
- HttpBackend            the whole Ray Serve app (`specserve serve`) over HTTP.
- VllmServeBackend       vLLM's own OpenAI server, target only (vllm_serve.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from specserve.acceptance.record import Acceptance
from specserve.tools.bench.workload import BenchArgs, Prompt


@dataclasses.dataclass
class RequestResult:
    prompt: Prompt
    token_ids: list[int] | None  # None where only text comes back (HTTP)
    text: str | None  # vLLM's detokenized output
    output_tokens: int
    start: float
    first: float | None
    end: float
    acceptance: Acceptance | None = None  # vLLM's per-request figures (None: not reported)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.output_tokens < 2:
            return None
        return (self.end - self.first) / (self.output_tokens - 1)


@dataclasses.dataclass
class Counters:
    """vLLM's spec-decode counters (engine-wide), for differences over a run."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_per_position: list[int] | None = None  # None: not reported (HTTP)

    def minus(self, other: "Counters") -> "Counters":
        def sub(a, b):
            if a is None or b is None:
                return None
            n = max(len(a), len(b))
            return [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]

        return Counters(self.num_drafts - other.num_drafts,
                        self.draft_tokens - other.draft_tokens,
                        self.accepted_tokens - other.accepted_tokens,
                        sub(self.accepted_per_position, other.accepted_per_position),
                        sub(self.draft_per_position, other.draft_per_position))



def _totals_counters(t) -> Counters:
    return Counters(t.num_drafts, t.draft_tokens, t.accepted_tokens,
                    list(t.accepted_per_position), list(t.draft_per_position))


def _sampling(params: dict):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=params["max_tokens"], temperature=params["temperature"],
                          ignore_eos=params["ignore_eos"])


class LocalBackend:
    """target_only, specserve_k0, specserve and specserve_synthetic: a LocalSpec."""

    def __init__(self, system: str, spec, alpha: float | None = None):
        self.system = system
        self.alpha = alpha
        self.spec = spec
        self.k = spec.k

    async def start(self):
        await self.spec.__aenter__()

    async def close(self):
        await self.spec.aclose()

    def counters(self) -> Counters:
        return _totals_counters(self.spec.totals)

    async def book(self) -> dict | None:
        """The sink's per-draft counters added up (specserve.acceptance.branches)."""
        from specserve.acceptance import branches

        return branches.total(await self.spec.sink_figures()) if self.k > 0 else None

    def extra(self) -> dict:
        syn = self.spec.synthetic
        out = ({"synthetic_delay_ms": syn.delay_ms, "synthetic_recovery_hit": syn.recovery_hit}
               if syn is not None else {})
        c = self.spec.controller
        if c is None:
            return out
        fit = self.spec.target_engine.step_costs.fit()
        return {**out, "adaptive_k": {str(k): n for k, n in sorted(c.decisions.items())},
                "adaptive_reason": c.last.reason if c.last else None,
                "fitted_step_ms": fit and fit[0] * 1e3,
                "fitted_ms_per_verified_token": fit and fit[1] * 1e3}

    async def generate(self, p: Prompt, params: dict) -> RequestResult:
        start = time.monotonic()
        seen = {"first": None, "o": None}

        def on_output(o):
            if seen["first"] is None and len(o.token_ids) > 0:
                seen["first"] = time.monotonic()
            seen["o"] = o

        ids = await self.spec.generate(p.ids, _sampling(params), on_output=on_output)
        return RequestResult(p, ids, seen["o"].text, len(ids), start, seen["first"],
                             time.monotonic(), Acceptance.of_output(seen["o"], self.k))


class VllmDraftModelBackend:
    """vLLM's co-located speculative decoding: draft_model (the draft runs in the
    target's workers, on the target's cores), or a draft with no model inside the
    engine: method "ngram", vLLM's prompt lookup (system vllm_ngram), or method
    "suffix", SuffixDecoding on Arctic Inference's suffix trees (system
    vllm_suffix; `make arctic` installs them)."""

    system = "vllm_draft_model"
    alpha = None

    def __init__(self, target: str, draft: str | None, k: int, settings,
                 method: str = "draft_model"):
        self.target, self.draft, self.k, self.settings = target, draft, k, settings
        self.method = method
        if method in ("ngram", "suffix"):
            self.system = f"vllm_{method}"
        self.started = None

    def speculative_config(self) -> dict:
        # vLLM's own defaults for each method at K drafted tokens a step, as
        # `vllm serve --speculative-config '{"method": M, "num_speculative_tokens": K}'`.
        if self.method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.k,
                    "prompt_lookup_max": 5, "prompt_lookup_min": 2}
        if self.method == "suffix":
            # Up to K per step (vLLM's default would be the tree depth, 24): the
            # same budget as specserve_suffix; its global tree keeps every
            # earlier request's output, as specserve's fleet memory does.
            return {"method": "suffix", "num_speculative_tokens": self.k}
        return {"method": "draft_model", "model": self.draft, "num_speculative_tokens": self.k}

    async def start(self):
        from specserve.engine import cpu_binding
        from specserve.target.engine import TargetEngine

        self.started = TargetEngine.start(
            self.target, self.settings, cpus=cpu_binding(1, model_draft=True)[0],
            speculative_config=self.speculative_config())
        self.engine, self.totals = self.started.engine, self.started.totals

    async def close(self):
        if self.started is not None:
            self.started.shutdown()
            self.started = None

    def counters(self) -> Counters:
        return _totals_counters(self.totals)

    def extra(self) -> dict:
        return {}

    async def generate(self, p: Prompt, params: dict) -> RequestResult:
        import uuid

        from vllm.inputs import TokensPrompt

        start, first, o = time.monotonic(), None, None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=p.ids),
                                              _sampling(params), uuid.uuid4().hex):
            o = out.outputs[0]
            if first is None and len(o.token_ids) > 0:
                first = time.monotonic()
        ids = list(o.token_ids)
        return RequestResult(p, ids, o.text, len(ids), start, first, time.monotonic(),
                             Acceptance.of_output(o, self.k))


class HttpBackend:
    """The whole Ray Serve app (`specserve serve`) over HTTP: streaming chat."""

    system = "specserve_http"
    alpha = None

    def __init__(self, target: str, draft: str, k: int, settings, workdir: Path,
                 branch_fan_out: int | None = None):
        self.target, self.draft, self.k, self.settings = target, draft, k, settings
        self.workdir = workdir
        self.branch_fan_out = branch_fan_out
        self.server = None
        self.name = "bench-target"

    def config(self) -> dict:
        engine = {"dtype": self.settings.dtype, "kv_cache_gib": self.settings.kv_cache_gib or 1,
                  "seed": self.settings.seed}
        if self.settings.max_model_len:
            engine["max_model_len"] = self.settings.max_model_len
        return {
            "target": {"model": self.target, "name": self.name, "engine": engine,
                       "resources": {"cpus_per_worker": 1}},
            "drafts": [{"name": "draft", "model": self.draft, "engine": engine,
                        "resources": {"cpus_per_worker": 0.25}}],
            "speculation": {"num_speculative_tokens": self.k,
                            **({} if self.branch_fan_out is None
                               else {"branch_fan_out": self.branch_fan_out})},
            "ray": {"num_cpus": 4},
        }

    async def start(self):
        from specserve.tools.serveproc import ServeProcess

        self.server = ServeProcess(self.config(), self.workdir)
        await asyncio.to_thread(self.server.wait_ready, self.name)

    async def close(self):
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server = None

    def counters(self) -> Counters:
        from specserve.tools.serveproc import get

        status, body = get(f"{self.server.url}/v1/spec/stats")
        if status != 200:
            raise RuntimeError(f"/v1/spec/stats answered {status}: {body}")
        e = body.get("target_engine") or {}
        return Counters(e.get("num_drafts", 0), e.get("draft_tokens", 0),
                        e.get("accepted_tokens", 0), list(e.get("accepted_per_position", [])),
                        None)

    def extra(self) -> dict:
        return {}

    async def generate(self, p: Prompt, params: dict) -> RequestResult:
        return await asyncio.to_thread(self._generate, p, params)

    def _generate(self, p: Prompt, params: dict) -> RequestResult:
        from specserve.tools.serveproc import stream_chat

        start = time.monotonic()
        body = {"model": self.name, "max_tokens": params["max_tokens"],
                "temperature": params["temperature"], "ignore_eos": params["ignore_eos"],
                "messages": p.messages(), "stream": True,
                "stream_options": {"include_usage": True}}
        text, first, usage = stream_chat(f"{self.server.url}/v1/chat/completions", body)
        n = (usage or {}).get("completion_tokens", 0)
        return RequestResult(p, None, text, n, start, first, time.monotonic())



def build_backends(a: BenchArgs, replay, workdir: Path):
    """(system, alpha, factory) in run order; factories build fresh backends."""
    from specserve.engine import EngineSettings
    from specserve.local import LocalSpec

    s = EngineSettings(max_model_len=a.max_model_len, seed=a.seed, dtype=a.dtype,
                       kv_cache_gib=a.kv_cache_gib)
    out = []
    for system in a.systems:
        if system == "target_only":
            out.append((system, None, lambda: LocalBackend(
                "target_only", LocalSpec(a.target, None, settings=s))))
        elif system == "specserve_k0":
            out.append((system, None, lambda: LocalBackend(
                "specserve_k0", LocalSpec(a.target, None, k=a.k, sink_only=True, settings=s))))
        elif system == "vllm_draft_model":
            out.append((system, None, lambda: VllmDraftModelBackend(a.target, a.draft, a.k, s)))
        elif system == "specserve":
            out.append((system, None, lambda: LocalBackend("specserve", LocalSpec(
                a.target, a.draft, k=a.k, settings=s, adaptive_k=not a.fixed_k,
                speculation=a.speculation()))))
        elif system == "specserve_adapted":
            out.append((system, None, lambda: LocalBackend("specserve_adapted", LocalSpec(
                a.target, a.adapted_draft, k=a.k, settings=s, adaptive_k=not a.fixed_k,
                speculation=a.speculation()))))
        elif system in ("vllm_ngram", "vllm_suffix"):
            method = system.removeprefix("vllm_")
            out.append((system, None, lambda method=method: VllmDraftModelBackend(
                a.target, None, a.k, s, method=method)))
        elif system == "specserve_suffix":
            # The suffix draft at a fixed K: it has no model to pay for, and the
            # K controller's figures are a model draft's (issue 26 item 4).
            out.append((system, None, lambda: LocalBackend("specserve_suffix", LocalSpec(
                a.target, "suffix", k=a.k, settings=s, speculation=a.speculation()))))
        elif system == "specserve_hybrid":
            # Fixed K too: the K controller's figures are the model's alone.
            out.append((system, None, lambda: LocalBackend("specserve_hybrid", LocalSpec(
                a.target, f"hybrid:{a.draft}", k=a.k, settings=s,
                speculation=a.speculation()))))
        elif system == "specserve_synthetic":
            for alpha in a.alphas:
                spec = (f"synthetic:{alpha:g}"
                        + (f"@{a.synthetic_delay_ms:g}ms" if a.synthetic_delay_ms else "")
                        + f",h{a.synthetic_recovery_hit:g}")
                out.append((system, alpha, lambda spec=spec, alpha=alpha: LocalBackend(
                    "specserve_synthetic", LocalSpec(a.target, spec, k=a.k, settings=s,
                                                     replay=replay(),
                                                     speculation=a.speculation()), alpha)))
        elif system == "vllm_serve":
            from specserve.tools.bench.vllm_serve import VllmServeBackend

            out.append((system, None, lambda: VllmServeBackend(a.target, a.draft, a.k, s,
                                                               workdir / "vllm_serve")))
        elif system == "specserve_http":
            out.append((system, None, lambda: HttpBackend(a.target, a.draft, a.k, s, workdir,
                                                          a.branch_fan_out)))
    return out

