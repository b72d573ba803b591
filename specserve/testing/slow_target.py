"""A proposer for tests that makes the target step slower than it is.

On real hardware the target is many times slower per step than its draft; with
tiny models on two shared cores both take the same few milliseconds, and a draft
no faster than its target cannot run ahead of it. Tests that need drafts to
arrive in time run the target with this subclass of the production proposer
(selected through SPECSERVE_PROPOSER_CLASS, read by
`specserve.target.engine.TargetEngine.start`), which sleeps
SPECSERVE_EMULATE_TARGET_STEP_MS milliseconds in every step before proposing:
a bigger target's forward pass. Never used outside tests.
"""

from __future__ import annotations

import os
import time

from specserve.target.proposer import RemoteDraftProposer

ENV_STEP_MS = "SPECSERVE_EMULATE_TARGET_STEP_MS"
CLASS_PATH = "specserve.testing.slow_target.SlowTargetProposer"


def env(step_ms: str | int) -> dict[str, str]:
    """Environment variables that make a target started with them slow."""
    return {"SPECSERVE_PROPOSER_CLASS": CLASS_PATH, ENV_STEP_MS: str(step_ms)}


class SlowTargetProposer(RemoteDraftProposer):
    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.step_s = float(os.environ.get(ENV_STEP_MS, "0")) / 1000.0

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        if self.step_s > 0:
            time.sleep(self.step_s)
        return super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                               slot_mappings)
