"""The draft model of a `kind: model` pool: a vLLM AsyncLLM, greedy, with branches.

Owns `VllmDraftModel`, the runner's DraftModel (specserve/draft/runner.py) over a
vLLM engine: the main line streamed one step at a time, the next-best tokens at
each drafted position (from the logprobs of the same forward pass), and the
branches' continuations as more greedy requests on the same engine. Per request,
it keeps those alternatives and continuations until the runner forgets them.

Never decides output and never sends anything to a target: the runner asks it
for tokens and branches and does the rest. Imports vLLM only when it runs.
"""

from __future__ import annotations

import asyncio

class VllmDraftModel:
    """A vLLM AsyncLLM as the draft: greedy, streamed one step at a time.

    With fan_out F > 0 it also branches: the main line asks vLLM for the top
    F + 1 logprobs of every drafted token (free: the same forward pass), so the
    next-best tokens of each position are known; a branch's continuation is one
    more greedy request on the engine (prefix + alternative), which vLLM's
    continuous batching runs in the same forward steps as the main lines."""

    def __init__(self, engine, max_model_len: int, fan_out: int = 0):
        self.engine = engine
        self.max_model_len = max_model_len
        self.fan_out = fan_out
        self._alts: dict[str, dict[int, list[int]]] = {}  # request -> position -> next-best
        # request -> (fork, alt) -> its continuation so far / the task drafting it
        # (by request: a step touches one request's, whatever the batch)
        self._conts: dict[str, dict[tuple[int, int], list[int]]] = {}
        self._tasks: dict[str, dict[tuple[int, int], asyncio.Task]] = {}

    def _params(self, max_tokens: int, logprobs: int | None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,  # the target decides where output ends
            detokenize=False,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA,
        )

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        from vllm.inputs import TokensPrompt

        self.forget(request_id)  # a new segment: the old line's alternatives are void
        alts = self._alts.setdefault(request_id, {}) if self.fan_out > 0 else None
        params = self._params(max_tokens, self.fan_out + 1 if alts is not None else None)
        gen = self.engine.generate(TokensPrompt(prompt_token_ids=tokens), params, segment_id)
        pos = len(tokens)
        try:
            async for out in gen:
                o = out.outputs[0]
                new = list(o.token_ids)
                if alts is not None and o.logprobs:
                    for i, (tok, lp) in enumerate(zip(new, o.logprobs)):
                        ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)
                        alts[pos + i] = [t for t, _ in ranked if t != tok][: self.fan_out]
                pos += len(new)
                if new:
                    yield new
        finally:
            await gen.aclose()  # aborts the vLLM request if we stopped early

    def branches(self, request_id, tokens, fork, count, length):
        """The next-best tokens at `fork`, each with as much of its continuation
        as the engine has drafted so far (started on first request)."""
        out = []
        tasks = self._tasks.setdefault(request_id, {})
        conts = self._conts.setdefault(request_id, {})
        for alt in self._alts.get(request_id, {}).get(fork, [])[:count]:
            key = (fork, alt)
            if key not in tasks:
                cont = conts[key] = []
                tasks[key] = asyncio.get_running_loop().create_task(
                    self._continue(f"{request_id}@{fork}:{alt}", cont,
                                   list(tokens[:fork]) + [alt], length))
            out.append([alt, *conts[key]])
        return out

    async def _continue(self, engine_id: str, cont: list[int], prefix: list[int],
                        length: int) -> None:
        from vllm.inputs import TokensPrompt

        gen = self.engine.generate(TokensPrompt(prompt_token_ids=prefix),
                                   self._params(length, None), engine_id)
        try:
            async for out in gen:
                cont.extend(out.outputs[0].token_ids)
        except asyncio.CancelledError:
            pass
        finally:
            await gen.aclose()

    def forget(self, request_id: str, before: int | None = None) -> None:
        """Drop a request's alternatives and branches (those forking before
        `before` only, when given) and stop their continuations."""
        alts = self._alts.get(request_id)
        if alts is not None:
            for p in [p for p in alts if before is None or p < before]:
                del alts[p]
            if before is None:
                del self._alts[request_id]
        tasks = self._tasks.get(request_id)
        if tasks is None:
            return
        conts = self._conts[request_id]
        for key in [k for k in tasks if before is None or k[0] < before]:
            tasks.pop(key).cancel()
            conts.pop(key, None)
        if before is None:
            del self._tasks[request_id], self._conts[request_id]
