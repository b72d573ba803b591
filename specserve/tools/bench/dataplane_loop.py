"""The emulated engine loop of `specserve bench dataplane`: vLLM's model runner as
the proposer sees it.

Owns the batch (rows, vLLM's `token_ids_cpu` / `num_tokens_no_spec` /
`sampled_token_ids`, and an input batch whose `req_ids` are vLLM's row ids),
each row's request and its true continuation T_r, one engine step at a time:
`propose()` (timed), the emulated verification (a row gains its accepted
tokens + 1 of T_r; a row at its context limit gets a new request, which
prefills first), then the model runner: a pure-Python busy loop that holds
the GIL for `gil_ms` of work (calibrated once with nothing competing, so
threads competing for the GIL make it take longer, as they would make a real
runner's kernel launches late) and `time.sleep` for the rest of the step (the
GPU; the GIL is released). Knows nothing of sinks or drafts: requests entering
and leaving the batch are callbacks (`specserve/tools/bench/dataplane.py`
wires them to its seams).
"""

from __future__ import annotations

import secrets
import time
import types
from collections.abc import Callable

import numpy as np

from specserve.tools.bench.dataplane_workload import Plan, accepted, plan_output, true_tokens

HELD = -1  # EngineLoop.prefill_left of a row waiting for activate_all()


def calibrate_gil(hold_s: float) -> int:
    """Busy-loop iterations that take hold_s here with nothing competing (best of 5)."""
    n = 200_000
    best = min(_timed_busy(n) for _ in range(5))
    return max(1, int(n * hold_s / best))


def _timed_busy(n: int) -> float:
    t = time.perf_counter()
    _busy(n)
    return time.perf_counter() - t


def _busy(n: int) -> int:
    x = 0
    for _ in range(n):  # pure bytecode: holds the GIL but for the switch interval
        x += 1
    return x


class EngineLoop:
    """vLLM's model runner as the proposer sees it: rows, their token ids, one step at a time."""

    def __init__(self, rows: int, context: int, plan: Plan, gil_work: int, proposer=None,
                 on_start: Callable | None = None, on_end: Callable[[str], None] | None = None,
                 rng_seed: int = 0):
        """on_start(rid, seed, known, end, k): a request entered the batch, its history
        known up to `known` tokens (T_r's); on_end(rid): it left. Both None: no drafts."""
        self.rows, self.context, self.plan = rows, context, plan
        self.k, self.vocab = plan.k, plan.draft.vocab
        self.gil_work = gil_work
        self.gpu_s = (plan.step_ms - plan.gil_ms) / 1000.0
        self.proposer = proposer
        self.on_start, self.on_end = on_start, on_end
        self.output = plan_output(plan, context)
        self.rng = np.random.default_rng(rng_seed)
        # vLLM's arguments: token_ids_cpu [rows, max context] int32, num_tokens_no_spec, sampled
        # Filled, not np.zeros: every page is resident from here on, so the RSS the
        # cell measures after this grows by what the sink keeps, not by these.
        self.token_ids = np.full((rows, context), 0, dtype=np.int32)
        self.truth = np.full((rows, context), 0, dtype=np.int32)  # T_r of each row's request
        self.num_tokens = np.zeros(rows, dtype=np.int32)
        self.sampled: list[list[int]] = [[] for _ in range(rows)]
        self.batch = types.SimpleNamespace(req_ids=[""] * rows)  # vLLM's InputBatch.req_ids
        self.rids = [""] * rows  # engine request ids
        self._seeds = iter(range(plan.seed * 1_000_000_007 + rows * context, 1 << 62))
        self.gained = self.verify_steps = 0
        self.waits: list[float] = []  # per step with a proposer: the sink's bounded wait
        # Engine steps a row still prefills (0: decoding; HELD: until activate_all()).
        # A prefilling row samples nothing, so propose() skips it, as vLLM's
        # chunked prefill has it; meanwhile its draft opens the request.
        self.prefill_left = np.zeros(rows, dtype=np.int64)

    def start_all(self) -> None:
        """Every row a request somewhere in its output (staggered, so they do not all
        end at once), held until `activate_all` (the cell waits for the sink to have
        them all, as if they had been running for a while)."""
        for i in range(self.rows):
            self._new_request(i, done=int(self.rng.integers(0, self.output)))

    def activate_all(self) -> None:
        for i in np.flatnonzero(self.prefill_left == HELD):
            self.prefill_left[i] = 0
            self.sampled[i] = [int(self.truth[i, self.num_tokens[i] - 1])]

    def stop_all(self) -> None:
        for i in range(self.rows):
            if self.on_end is not None and self.rids[i]:
                self.on_end(self.rids[i])
            self.rids[i] = ""

    def _new_request(self, i: int, done: int | None = None) -> None:
        """Row i gets a new request, prompt T_r[:P] (P = context - output): prefilled
        in the next steps, or (`done`) held with `done` + 1 output tokens already."""
        old = self.rids[i]
        if old and self.on_end is not None:
            self.on_end(old)
        seed = next(self._seeds)
        rid = f"dp-{secrets.token_hex(8)}"
        self.rids[i] = rid
        self.batch.req_ids[i] = f"{rid}-{secrets.token_hex(4)}"  # vLLM's row id: id + 8 hex
        prompt = self.context - self.output
        n = prompt if done is None else prompt + 1 + done
        self.truth[i] = true_tokens(seed, 0, self.context, self.vocab)
        self.token_ids[i, :n] = self.truth[i, :n]
        self.num_tokens[i] = n
        self.sampled[i] = []
        self.prefill_left[i] = HELD if done is not None else \
            -(-prompt // self.plan.prefill_tokens_per_step)
        if self.on_start is not None:  # (known: up to the last token sampled)
            self.on_start(rid, seed, n if done is None else n - 1, self.context, self.k)

    def step(self) -> tuple[float, float | None]:
        """One engine step: (step seconds, propose seconds or None without a proposer)."""
        t0 = time.monotonic()
        proposals, took = None, None
        if self.proposer is not None:
            proposals = self.proposer.propose(self.sampled, self.num_tokens, self.token_ids)
            took = time.monotonic() - t0
            # of which the sink's bounded wait for fresh drafts (a decision, not work)
            self.waits.append(getattr(self.proposer.sink, "last_wait_s", 0.0))
        self._verify(proposals)
        _busy(self.gil_work)  # the model runner launching kernels
        time.sleep(self.gpu_s)  # the GPU
        return time.monotonic() - t0, took

    def _verify(self, proposals) -> None:
        k1 = self.k + 1
        for i in range(self.rows):
            n = int(self.num_tokens[i])
            if self.prefill_left[i]:
                if self.prefill_left[i] > 0:
                    self.prefill_left[i] -= 1
                if self.prefill_left[i] == 0:  # the prefill's last chunk samples a token
                    self.token_ids[i, n] = self.truth[i, n]
                    self.num_tokens[i] = n + 1
                    self.sampled[i] = [int(self.truth[i, n])]
                continue
            truth = self.truth[i, n: n + k1].tolist()
            gain = min(accepted(proposals[i], truth) + 1 if proposals else 1, self.context - n)
            self.token_ids[i, n: n + gain] = truth[:gain]
            self.num_tokens[i] = n + gain
            self.sampled[i] = truth[:gain]
            self.gained += gain
            self.verify_steps += 1
            if n + gain >= self.context:
                self._new_request(i)

    def run_for(self, seconds: float, between: Callable[[], None] | None = None,
                until: Callable[[], bool] | None = None) -> tuple[list[float], list[float]]:
        """Step for `seconds` (or until `until()`): (step times, propose times)."""
        steps, proposes = [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until is not None and until()):
            if between is not None:
                between()
            s, p = self.step()
            steps.append(s)
            if p is not None:
                proposes.append(p)
        return steps, proposes
