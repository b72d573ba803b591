"""The one draft worker: a draft model and the runner that speculates with it.

Owns starting and stopping what every draft replica runs, whoever drives it: a
draft model (a vLLM engine for a model folder, the synthetic replay for
`synthetic:A[@Dms]`, or the suffix memory for `suffix`) and its `DraftRunner`,
which streams drafts to target sinks. Serve's draft replica
(`deployments/draft.py`, driven by Ray streaming calls) and the stand-alone
draft process (`specserve/draft/server.py`, driven by the gRPC Drafter service
that `specserve generate` uses) both start one with `DraftWorker.start`. It
never talks HTTP and never decides output.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from specserve.draft.runner import BranchPlan, DraftRunner, VllmDraftModel
from specserve.engine import EngineSettings, apply_cpu_env, engine_args, shutdown_engine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DraftWorker:
    runner: DraftRunner
    engine: object | None  # the vLLM engine (None for the synthetic and suffix drafts)
    procs: list

    @classmethod
    def start(cls, model: str, settings: EngineSettings, *, tls=None, cpus: str | None = None,
              replay_path: str | None = None, vocab_size: int | None = None,
              branches: BranchPlan | None = None, name: str = "",
              suffix=None) -> "DraftWorker":
        """model: a draft model folder, 'default' (the shipped distilled draft),
        synthetic:A[@Dms][,hH] (needs replay_path and vocab_size: the target's greedy
        outputs and vocabulary), or 'suffix' (no model: a suffix memory set by
        `suffix`, a SuffixConfig; None: its defaults). tls: mutual TLS to the
        sinks (TlsFiles). cpus: OpenMP core list of a CPU engine (unless the environment sets one).
        branches: pre-draft alternatives (BranchPlan; None: none). name:
        "model/replica", how the target sinks' figures name this draft."""
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
            return cls(DraftRunner(draft_model, tls=tls, branches=branches, name=name), None, [])
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
            return cls(DraftRunner(draft_model, tls=tls, branches=branches, name=name), None, [])
        from specserve.models import resolve_draft
        from specserve.engine import start_engine

        apply_cpu_env(settings)
        if cpus and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus  # ignored on GPUs
        engine, procs = start_engine(engine_args(resolve_draft(model), settings))
        # Branches from the engine's own logprobs, continued as batched requests:
        # one batched step on an accelerator, but a whole draft step per branch
        # on a CPU core, where pre-drafting starves the main line (measured:
        # the draft never got ahead of the target, tests/target/test_faults.py).
        # So a vLLM draft on CPU does not pre-draft; the synthetic draft models
        # the accelerator case.
        from vllm.platforms import current_platform

        if branches is not None and branches.active and current_platform.is_cpu():
            log.info("draft on CPU: pre-drafting branches is off (each branch costs a draft step)")
            branches = None
        fan = branches.fan_out if branches is not None and branches.active else 0
        runner = DraftRunner(VllmDraftModel(engine, engine.model_config.max_model_len, fan_out=fan),
                             tls=tls, branches=branches, name=name)
        return cls(runner, engine, procs)

    async def check_health(self) -> None:
        if self.engine is not None:
            await self.engine.check_health()

    async def close(self) -> None:
        log.info("draft shutting down: %s", self.runner.stats)
        await self.runner.close()
        if self.engine is not None:
            shutdown_engine(self.engine, self.procs)
            self.engine = None
