"""RemoteDraftProposer: vLLM's `custom_class` proposer that serves remote drafts.

The target engine is built with
    speculative_config={"method": "custom_class",
                        "model": "specserve.target.proposer.RemoteDraftProposer",
                        "num_speculative_tokens": K}
and vLLM instantiates this class in every worker. In TP rank 0 `load_model`
starts the draft sink (gRPC) with the settings `TargetEngine.start` left in
the environment (`specserve.target.sink_settings.SinkSettings`: vLLM builds
this class itself, in its own worker processes); other ranks propose nothing
(vLLM uses rank 0's drafts). Rows are found by request id: the worker hook
(`specserve.target.worker_hook`) hands the proposer vLLM's input batch, whose
`req_ids` name each row. `propose` runs inside the engine step: it reads what
the sink has buffered and returns at once, except for the bounded wait after a
rejection (specserve/target/sink.py; never longer than max_wait_ms, and only
when the rate model says it pays).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from specserve import logs
from specserve.target import worker_hook
from specserve.target.sink import DraftSink
from specserve.target.sink_settings import ENV as SINK_ENV
from specserve.target.sink_settings import SinkSettings

log = logging.getLogger(__name__)

CLASS_PATH = "specserve.target.proposer.RemoteDraftProposer"


def speculative_config(k: int, class_path: str = CLASS_PATH) -> dict:
    """The vLLM speculative_config that plugs this proposer (or a subclass) in."""
    return {"method": "custom_class", "model": class_path, "num_speculative_tokens": k}


class RemoteDraftProposer:
    def __init__(self, vllm_config):
        from specserve.target import vllm_fixes

        vllm_fixes.apply()  # before the first verification step
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.sink: DraftSink | None = None
        self._batch = None  # vLLM's input batch (its req_ids name the rows)
        self._randomized = worker_hook.ids_randomized()
        self._row_ids: list = []  # the batch's row ids at the last step ...
        self._keys: list = []  # ... and the sink's keys for them

    def attach_batch(self, input_batch) -> None:
        """The model runner's input batch (`req_ids`: each row's vLLM request id)."""
        self._batch = input_batch

    def row_keys(self, n: int) -> list | None:
        """The sink's key of each of the first n rows (None: no batch attached).
        Recomputed only when the batch's rows changed since the last step."""
        if self._batch is None:
            return None
        ids = self._batch.req_ids[:n]
        if ids != self._row_ids:
            self._row_ids = ids
            self._keys = [worker_hook.row_key(r, self._randomized) for r in ids]
        return self._keys

    def load_model(self, *args, **kwargs) -> None:
        # vLLM calls this once per worker after the target model is loaded.
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            return
        logs.to_stderr("sink")
        settings = SinkSettings.from_env()
        if settings is None:
            log.warning("no sink settings (%s): the target runs without remote drafts", SINK_ENV)
            return
        sink = DraftSink(
            self.vocab_size,
            max_pending=max(settings.max_pending, self.k),
            max_prompt_len=self.max_model_len,
            max_wait_s=settings.max_wait_ms / 1000.0,
            release_after=settings.release_after_steps,
            max_stream_messages_per_s=settings.max_stream_messages_per_s,
            per_request_k=settings.per_request_k,
        )
        port = sink.start(settings.address, tls=settings.tls)
        if settings.port_file:
            tmp = f"{settings.port_file}.tmp"
            with open(tmp, "w") as f:
                f.write(str(port))
            os.replace(tmp, settings.port_file)
        self.sink = sink

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec,
        token_ids_cpu,
        slot_mappings=None,
    ) -> list[list[int]]:
        n = len(sampled_token_ids)
        if self.sink is None:
            return [[] for _ in range(n)]
        # Row i's history is token_ids_cpu[i, :num_tokens_no_spec[i]]; the sink
        # reads only what each row gained since the last step.
        lengths = np.asarray(num_tokens_no_spec[:n])
        active = [bool(s) for s in sampled_token_ids]
        proposals = self.sink.propose(token_ids_cpu, lengths, active, self.k,
                                      keys=self.row_keys(n))
        # Never draft past the context: vLLM would refuse the positions.
        near = np.flatnonzero(lengths + self.k + 1 > self.max_model_len)
        for i in near.tolist():
            room = self.max_model_len - int(lengths[i]) - 1
            if len(proposals[i]) > room:
                proposals[i] = proposals[i][: max(room, 0)]
        return proposals
