"""The one draft worker: a draft model, the runner that speculates with it, and its entry point.

Owns starting and stopping what every draft replica runs, whoever hosts it: a
draft model (a vLLM engine for a model folder, the synthetic replay for
`synthetic:A[@Dms]`, or the suffix memory for `suffix`) and its `DraftRunner`, which streams drafts to target
sinks; and `DraftWorker.draft`, the one way a target asks for drafts: a stream
that drafts for one registered request for as long as the caller follows it.
Serve's draft replica (`deployments/draft.py`) exposes it as a Ray streaming
call; LocalSpec (`specserve generate`, the bench, the calibration,
`make gpu-check`) hosts a worker in its own process and follows the same
stream. It never talks HTTP and never decides output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator

from specserve.draft.model import VllmDraftModel
from specserve.draft.runner import BranchPlan, DraftRunner
from specserve.engine import (EngineSettings, apply_cpu_env, engine_args, scoped_env,
                              shutdown_engine)

log = logging.getLogger(__name__)

# A sink unreachable this long means its target is gone (a restarted target
# listens elsewhere): stop drafting for its requests, whether or not the
# caller's stream is ever cancelled.
SINK_LOST_S = 30.0


@dataclasses.dataclass
class DraftWorker:
    runner: DraftRunner
    engine: object | None  # the vLLM engine (None for the synthetic and suffix drafts)
    procs: list

    @classmethod
    def start(cls, model: str, settings: EngineSettings, *, tls=None, cpus: str | None = None,
              replay_path: str | None = None, vocab_size: int | None = None,
              branches: BranchPlan | None = None, name: str = "",
              suffix=None, adapt=None) -> "DraftWorker":
        """model: a draft model folder, 'default' (the shipped distilled draft),
        synthetic:A[@Dms][,hH] (needs replay_path and vocab_size: the target's greedy
        outputs and vocabulary), 'suffix' (no model: a suffix memory set by
        `suffix`, a SuffixConfig; None: its defaults), or hybrid:FOLDER (the
        model FOLDER consulting a suffix memory set by `suffix`). tls: mutual TLS to the
        sinks (TlsFiles). cpus: OpenMP core list of a CPU engine (unless the environment sets one).
        branches: pre-draft alternatives (BranchPlan; None: none). name:
        "model/replica", how the target sinks' figures name this draft. adapt:
        an AdaptBuffer the runner feeds with the verified tokens (None: none)."""
        from specserve.draft import hybrid as hybrid_draft
        from specserve.draft import suffix as suffix_draft
        from specserve.draft import synthetic

        if tls is not None:
            tls.read()  # a missing file fails here, with its path
        if suffix_draft.is_suffix(model):
            fan = branches.fan_out if branches is not None and branches.active else 0
            draft_model = suffix_draft.SuffixDraftModel(
                suffix, max_model_len=settings.max_model_len or (1 << 30),
                vocab_size=vocab_size, fan_out=fan)
            log.info("suffix draft: %s", draft_model.config)
            return cls(DraftRunner(draft_model, tls=tls, branches=branches, name=name,
                                   adapt=adapt), None, [])
        if synthetic.is_synthetic(model):
            if replay_path is None or vocab_size is None:
                raise ValueError("a synthetic draft needs the target's recorded outputs "
                                 "(replay) and vocabulary size")
            replay = synthetic.Replay.load(replay_path)
            log.info("synthetic draft %s: %d recorded prompts", model, len(replay))
            draft_model = synthetic.SyntheticDraftModel(
                synthetic.parse(model), replay, vocab_size, seed=settings.seed,
                max_model_len=settings.max_model_len or (1 << 30),
                fan_out=max(branches.fan_out, 1) if branches is not None else synthetic.FAN_OUT)
            return cls(DraftRunner(draft_model, tls=tls, branches=branches, name=name,
                                   adapt=adapt), None, [])
        hybrid = hybrid_draft.is_hybrid(model)
        folder = hybrid_draft.model_of(model) if hybrid else model
        engine, procs = cls.start_model_engine(folder, settings, cpus)
        # Branches from the engine's own logprobs, continued as batched requests:
        # one batched step on an accelerator, but a whole draft step per branch
        # on a CPU core, where pre-drafting starves the main line (measured:
        # the draft never got ahead of the target, tests/target/test_faults.py).
        # So a vLLM draft on CPU does not pre-draft from its model; the
        # synthetic draft models the accelerator case. (A hybrid draft's memory
        # branches cost no model step: they stay.)
        from vllm.platforms import current_platform

        model_fan = branches.fan_out if branches is not None and branches.active else 0
        if model_fan and current_platform.is_cpu():
            log.info("draft on CPU: pre-drafting branches from the model is off "
                     "(each branch costs a draft step)")
            model_fan = 0
            branches = branches if hybrid else None
        draft_model = VllmDraftModel(engine, engine.model_config.max_model_len, fan_out=model_fan)
        if hybrid:
            memory = suffix_draft.SuffixDraftModel(
                suffix, max_model_len=engine.model_config.max_model_len,
                vocab_size=engine.model_config.get_vocab_size(),
                fan_out=branches.fan_out if branches is not None and branches.active else 0)
            log.info("hybrid draft: %s with a suffix memory %s", folder, memory.config)
            draft_model = hybrid_draft.HybridDraftModel(draft_model, memory)
        runner = DraftRunner(draft_model, tls=tls, branches=branches, name=name,
                             adapt=adapt)
        return cls(runner, engine, procs)

    @staticmethod
    def start_model_engine(folder: str, settings: EngineSettings, cpus: str | None):
        """A vLLM engine for a draft model folder ('default': the shipped draft)."""
        from specserve.engine import start_engine
        from specserve.models import resolve_draft

        apply_cpu_env(settings)
        # The engine's processes read the core list at spawn (ignored on GPUs);
        # the user's own setting wins.
        env = {"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus and \
            "VLLM_CPU_OMP_THREADS_BIND" not in os.environ else {}
        with scoped_env(env):
            return start_engine(engine_args(resolve_draft(folder), settings))

    async def draft(self, request_id: str, prompt_ids: list[int], sink_address: str,
                    lookahead: int, max_tokens: int, k: int = 0,
                    ticket: str = "", poll_s: float = 5.0) -> AsyncIterator[dict]:
        """Draft for one request the target registered at its sink (with
        `ticket`) until the caller stops following this stream, or the sink
        has been unreachable for SINK_LOST_S. Yields once, at the start:
        {"lag": this worker's mean tokens behind the verified position}.
        Raises ValueError for a request it cannot draft (the caller's error)."""
        self.runner.start(request_id, prompt_ids, sink_address, lookahead, max_tokens, k,
                          ticket=ticket)
        try:
            _, lag = self.runner.timeliness()
            yield {"lag": lag}
            while True:
                await asyncio.sleep(poll_s)
                down = self.runner.sink_down_for(sink_address)
                if down > SINK_LOST_S:
                    log.warning("sink %s unreachable for %.0f s: stop drafting %s",
                                sink_address, down, request_id)
                    return
        finally:
            self.runner.cancel(request_id)

    async def check_health(self) -> None:
        if self.engine is not None:
            await self.engine.check_health()

    async def close(self) -> None:
        figures = getattr(self.runner.model, "figures", None)  # a hybrid draft's sources
        log.info("draft shutting down: %s%s", self.runner.stats,
                 f" sources={figures()}" if figures is not None else "")
        await self.runner.close()
        if self.engine is not None:
            shutdown_engine(self.engine, self.procs)
            self.engine = None
