"""What the draft sink measures of time: the engine's step and the draft's speed.

Owns two estimates the sink decides with, both pure (the caller passes the
time, so they are tested without a clock):
- `StepClock`: the engine's step as the proposer sees it (from one propose()
  to the next), the tokens its rows gain per step, and the verify step's cost
  a + b · tokens fitted over steady decode steps (same rows, every row
  sampling). The bounded wait, per-request K's price and the K controller's
  cost (via `DraftSink.step_cost`) read it.
- `DraftSpeed`: how fast drafts answer a miss (a verified update that found no
  drafts): the round trip to the first fresh drafts, then the time per token
  of the next ones. The bounded wait's deadline reads it.
"""

from __future__ import annotations

import collections

from specserve.acceptance.record import percentile
from specserve.control import policy
from specserve.control.stepcost import StepCostFit

EWMA = 0.2  # weight of a new sample in the step and draft-speed estimates
IDLE_S = 2.0  # a gap between two propose() calls longer than this: the engine was idle
COST_REFIT = 16  # steady steps between two fits of the verify step's cost
# The wait's deadline is a high percentile of the draft's recent round trips
# (verified update out -> first fresh drafts), higher the more rows wait
# (policy.round_trip_percentile): a wait ends as soon as the drafts are in, so a
# deadline at the mean would give up on half of them.
ROUND_TRIP_SAMPLES = 64


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - EWMA) * old + EWMA * new


class StepClock:
    """The engine's step, measured from one propose() to the next."""

    def __init__(self) -> None:
        self.step_s: float | None = None  # one engine step without the wait
        self.emitted: float | None = None  # tokens the rows gain per step
        self.fit = StepCostFit()
        self.cost: policy.StepCost | None = None  # the fit, redone every COST_REFIT steps
        self._fitted_steps = 0
        self._last: float | None = None  # when the previous propose() handed its step over
        self._last_step: tuple[int, int] | None = None  # its (rows, tokens verified)

    def tick(self, now: float, rows: int, every_row_samples: bool) -> bool:
        """A propose() begins at `now` for `rows` rows: the time since the last
        one handed its step over was the engine's step. False if the engine was
        idle in between (nothing measured)."""
        if self._last is None or now - self._last >= IDLE_S:
            return False
        took = now - self._last
        self.step_s = ewma(self.step_s, took)
        if self._last_step is not None and self._last_step[0] == rows and every_row_samples:
            self.fit.add(self._last_step[1], took)
            self._fitted_steps += 1
            if self.cost is None or self._fitted_steps % COST_REFIT == 0:
                self.cost = self.fit.cost()  # (not every step: the engine waits)
        return True

    def gained(self, tokens_per_row: float) -> None:
        """The tokens the rows gained this step (after a tick that measured)."""
        self.emitted = ewma(self.emitted, tokens_per_row)

    def hand_over(self, now: float, rows: int, tokens: int) -> None:
        """propose() returns at `now`: the engine's step of `rows` rows
        verifying `tokens` tokens starts."""
        self._last = now
        self._last_step = (rows, tokens)

    def price(self) -> float:
        """What one more verified token costs the batch, in tokens it emits: the
        measured cost per token (s) times the batch's output rate (tokens per
        step / seconds per step). 0 until measured."""
        if self.cost is None or not self.step_s or not self.emitted:
            return 0.0
        return policy.token_cost(self.cost) * self.emitted / self.step_s


class DraftSpeed:
    """How fast drafts answer a miss, by request."""

    def __init__(self) -> None:
        self.token_s: float | None = None  # per drafted token after the first
        self.round_trips: collections.deque = collections.deque(maxlen=ROUND_TRIP_SAMPLES)
        # request -> [when its miss's update went out, when the first fresh drafts came]
        self._missed: dict = {}

    def missed(self, key, now: float) -> None:
        self._missed[key] = [now, None]

    def waiting(self, key) -> bool:
        return key in self._missed

    def forget(self, key=None) -> None:
        """Stop timing one request (None: every request)."""
        if key is None:
            self._missed.clear()
        else:
            self._missed.pop(key, None)

    def __len__(self) -> int:
        return len(self._missed)

    def arrived(self, key, added: int, now: float, done: bool = False) -> None:
        """Drafts for `key` came in at `now`: the first fresh drafts' latency
        (round trip included; an answer that it has none counts too), then the
        time per token of the next ones."""
        times = self._missed.get(key)
        if times is None:
            return
        if times[1] is None:
            self.round_trips.append(now - times[0])
            if added >= 4:  # the draft sends its tokens in bulk: no wait per token
                self.token_s = ewma(self.token_s, 0.0)
                del self._missed[key]
            elif done:  # all it has: nothing to time per token
                del self._missed[key]
            else:
                times[1] = now
        else:
            if added:
                self.token_s = ewma(self.token_s, (now - times[1]) / added)
            del self._missed[key]

    def first_token_s(self, waiting_rows: int) -> float | None:
        """The round trip the wait's deadline allows for (None: none measured)."""
        return percentile(self.round_trips, policy.round_trip_percentile(waiting_rows))
