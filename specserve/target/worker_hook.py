"""The target worker's hook: vLLM's `worker_extension_cls`, through which the
target's engine client reaches the draft sink in TP rank 0.

Owns two collective RPCs that vLLM runs in every worker between engine steps
(`AsyncLLM.collective_rpc`): `specserve_register` (a request's id, prompt, K,
end and ticket go to the sink before its first step) and `specserve_unregister`
(the request ended). Registering also hands the proposer the model runner's
input batch, whose `req_ids` name each batch row's request: the proposer finds
rows by id (`RemoteDraftProposer.attach_batch`), never by token history.

Also owns `row_key`: vLLM adds 8 random characters to every engine request id
it is given (`InputProcessor.assign_request_id`: "{id}-{8 chars}"), and names
the sequences of an n > 1 request "{index}_{that}"; the sink keys requests by
the id the engine client gave (`sequence_id`). Only vLLM's documented hook and
its RPC are used; no vLLM file or class is patched. Other TP ranks do nothing.
"""

from __future__ import annotations

import os

CLASS_PATH = "specserve.target.worker_hook.SinkWorkerExtension"
_SUFFIX = 9  # "-" and 8 random characters


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The sink's key for sequence `index` of an engine request with n
    sequences: vLLM's own child naming ("{index}_{id}" for n > 1)."""
    return request_id if n <= 1 else f"{index}_{request_id}"


def row_key(row_id: str | None, randomized: bool = True) -> str | None:
    """The sink's key of a batch row's vLLM request id."""
    if row_id is None:
        return None
    if randomized and len(row_id) > _SUFFIX and row_id[-_SUFFIX] == "-":
        return row_id[:-_SUFFIX]
    return row_id


def ids_randomized() -> bool:
    """Whether vLLM adds its random suffix to request ids here."""
    return os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") in ("", "0", "false",
                                                                           "False")


class SinkWorkerExtension:
    """Mixed into vLLM's worker class (vLLM's `worker_extension_cls`)."""

    def _specserve_proposer(self):
        runner = getattr(self, "model_runner", None)
        proposer = getattr(runner, "drafter", None)
        if proposer is None or getattr(proposer, "sink", None) is None:
            return None  # another TP rank, or no sink configured
        # The runner may rebuild its input batch while it starts: hand the
        # current one every time (an assignment).
        proposer.attach_batch(runner.input_batch)
        return proposer

    def specserve_register(self, request_id: str, prompt: list[int], ticket: str, k: int = 0,
                           end: int = 0) -> bool:
        """Register one sequence with the sink; False where there is none (not
        rank 0) or it refused (then the sequence runs without drafts)."""
        proposer = self._specserve_proposer()
        if proposer is None:
            return False
        from specserve.target.book import BookError

        try:
            proposer.sink.register(request_id, prompt, ticket, k=k, end=end)
        except BookError as e:
            import logging

            logging.getLogger(__name__).warning("draft registration of %s refused: %s",
                                                request_id, e.message)
            return False
        return True

    def specserve_unregister(self, request_id: str) -> bool:
        proposer = self._specserve_proposer()
        if proposer is None:
            return False
        proposer.sink.unregister(request_id)
        return True
