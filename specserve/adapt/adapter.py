"""The draft adapter: one draft replica's online adaptation, from the traffic it
collected to the weights it serves.

Owns the schedule, the training process and the swap:
- Every `train_every_minutes` (or sooner, when the serving weights' held-out
  alpha fell `alpha_drop_trigger` below what it was when they started serving),
  the replica holding the pool's train lock (a file in its versions folder, so
  one replica of a pool trains at a time) runs a round: in a separate process,
  at low priority on `train_threads` threads (and the draft's own cores), it
  measures the serving weights on the buffer's held-out slice
  (`specserve.adapt.evaluate`), fine-tunes a copy of them on the train slice
  (`specserve.adapt.train`, at most `train_minutes`), and measures the copy on
  the same slice. The guard (`specserve.adapt.guard.judge`) decides; the
  candidate is recorded either way (`specserve.adapt.versions`; a refused
  one's weights are not kept) and promoted only when the guard says so.
- Every replica of the pool follows the store's current version: when it
  changes (a promotion here or on another replica, or `specserve adapt
  rollback`), the replica loads it into its draft engine in place (vLLM's
  `reload_weights`, between two engine steps). No request is dropped, and
  none can go wrong: drafts are hints, the target decides every token.

The examples go to the training process through a pipe, never to disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from specserve.adapt.buffer import AdaptBuffer, Example
from specserve.adapt.figures import RoundFigures
from specserve.adapt.guard import HeldOutAlpha, judge
from specserve.adapt.versions import SHIPPED, VersionStore

log = logging.getLogger(__name__)

POLL_S = 5.0  # how often a replica looks at the store's current version
LOCK = "train.lock"
HEAD = ".head"  # + "-" + the version it was trained from


def progress(serving: HeldOutAlpha, candidate: HeldOutAlpha) -> bool:
    """Whether a refused candidate is worth training on: it did at least as
    well as the serving weights on the held-out slice."""
    return (serving.alpha is not None and candidate.alpha is not None
            and candidate.alpha >= serving.alpha)


def cores(spec: str | None) -> list[int]:
    """The cores of an OpenMP core list ("1", "2-3", "0,2-3"; None: none)."""
    out: list[int] = []
    for part in (spec or "").replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit():
            out += range(int(first), int(last or first) + 1)
    return out


def _training_process(threads: int, cpus: str | None) -> None:
    """The training process: below drafting in priority, on the draft's cores,
    and gone with its replica (Linux: the parent's death kills it)."""
    import torch

    _die_with_parent()
    os.nice(10)
    if cores(cpus):
        os.sched_setaffinity(0, cores(cpus))
    torch.set_num_threads(threads)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when the process that started it
    ends, so a round never outlives its replica (a no-op off Linux)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def measure(folder: str, heldout: list[Example], threads: int) -> tuple[int, int]:
    """In the training process: the weights in `folder` on the held-out slice."""
    from specserve.adapt.evaluate import heldout_alpha

    return heldout_alpha(folder, heldout, threads=threads)


def train_round(serving_folder: str, start: str, train: list[Example], heldout: list[Example],
                out: str, minutes: float, threads: int, lr: float) -> dict:
    """In the training process: the serving weights' alpha, a copy of `start`
    (the serving weights, or the training head) fine-tuned into `out`, its alpha."""
    from specserve.adapt.train import fine_tune

    serving = measure(serving_folder, heldout, threads)
    result = fine_tune(start, train, out, minutes=minutes, threads=threads, lr=lr)
    candidate = measure(out, heldout, threads)
    return {"serving": serving, "candidate": candidate,
            "train": dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result}


class DraftAdapter:
    def __init__(self, config, buffer: AdaptBuffer, versions: VersionStore, source: str,
                 load: Callable[[str], Awaitable[None]], cpus: str | None = None,
                 clock: Callable[[], float] = time.monotonic, run=None):
        """config: the pool's AdaptConfig; source: the shipped draft's folder
        (v0's weights); load(folder): loads weights into the draft engine;
        cpus: the draft's OpenMP core list (training runs there); run(fn,
        *args): awaits fn(*args) somewhere (None: in the training process)."""
        self.config = config
        self.buffer = buffer
        self.versions = versions
        self.source = source
        self.load = load
        self.cpus = cpus
        self.clock = clock
        self.figures = RoundFigures()
        self.loaded = SHIPPED  # the engine starts with the shipped weights
        self._last_round = clock()
        self._last_check = clock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._run = run or self._in_training_process
        self.task: asyncio.Task | None = None

    # ---- the loop ------------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.follow()
                if self.due():
                    await self.round()
                elif self.check_due():
                    await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # adaptation costs speed at worst, never the replica
                log.exception("adapt: round failed; the serving weights stay")
                self._last_round = self.clock()
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def abandon(self) -> None:
        """The replica is going (`DraftServer.__del__`; synchronous, as a
        destructor must be): the loop is cancelled, a round's training process
        killed, and the pool's train lock, where this replica holds it, removed
        at once rather than left to expire."""
        if self.task is not None:
            self.task.cancel()
        if self._pool is not None:
            processes = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:  # a running round is not cancelled by shutdown
                p.kill()
            self._pool = None
        root = getattr(self.versions, "root", None)
        if root is None:
            return
        lock = Path(root) / LOCK
        try:
            if lock.read_text() == str(os.getpid()):
                lock.unlink(missing_ok=True)
        except OSError:
            pass
        for out in Path(root).glob(f".candidate-{os.getpid()}"):
            shutil.rmtree(out, ignore_errors=True)

    # ---- following the pool's version --------------------------------------------------

    def folder(self, version: str) -> str:
        return self.source if version == SHIPPED else str(self.versions.path(version))

    async def follow(self) -> bool:
        """Load the store's current version if it is not the one serving here."""
        current = self.versions.current()
        if current == self.loaded:
            return False
        await self.load(self.folder(current))
        log.info("adapt: serving %s (was %s)", current, self.loaded)
        self.loaded = current
        self.figures.started = None  # measured at the next check
        self.figures.serving = None
        return True

    # ---- training ----------------------------------------------------------------------

    def due(self) -> bool:
        if self.clock() - self._last_round >= self.config.train_every_minutes * 60:
            return True
        f, drop = self.figures, self.config.alpha_drop_trigger
        return (drop is not None and f.started is not None and f.serving is not None
                and f.started.alpha is not None and f.serving.alpha is not None
                and f.serving.positions >= self.config.min_heldout_positions
                and f.serving.alpha < f.started.alpha - drop)

    def check_due(self) -> bool:
        """Re-measure the serving weights for the drop trigger (a sixth of the schedule)."""
        return (self.config.alpha_drop_trigger is not None
                and self.clock() - self._last_check >= self.config.train_every_minutes * 10)

    def _enough(self) -> str | None:
        if self.buffer.heldout_positions < self.config.min_heldout_positions:
            return (f"waiting for held-out data ({self.buffer.heldout_positions} of "
                    f"{self.config.min_heldout_positions} positions)")
        if self.buffer.train_tokens == 0:
            return "waiting for training data"
        return None

    async def _in_training_process(self, fn, *args):
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_training_process, initargs=(self.config.train_threads, self.cpus))
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def check(self) -> None:
        """Measure the serving weights on the held-out slice (the drop trigger's input)."""
        self._last_check = self.clock()
        if self._enough() is not None:
            return
        serving = HeldOutAlpha.of(await self._run(
            measure, self.folder(self.loaded), self.buffer.heldout_examples(),
            self.config.train_threads))
        self.figures.serving = serving
        if self.figures.started is None:
            self.figures.started = serving

    async def round(self) -> str | None:
        """One training round; the new version if the guard let it serve. A
        round that cannot run yet (too little data, another replica training)
        leaves the schedule due: it is tried again at the next poll."""
        waiting = self._enough()
        if waiting is not None:
            self.figures.last = waiting
            return None
        lock = self.versions.root / LOCK
        if not self._take(lock):
            self.figures.last = "another replica of the pool is training"
            return None
        self._last_round = self._last_check = self.clock()
        out = self.versions.root / f".candidate-{os.getpid()}"
        try:
            shutil.rmtree(out, ignore_errors=True)
            parent = self.loaded
            head = self.head(parent)
            started = time.monotonic()
            result = await self._run(
                train_round, self.folder(parent), str(head) if head else self.folder(parent),
                self.buffer.train_examples(), self.buffer.heldout_examples(), str(out),
                self.config.train_minutes, self.config.train_threads, self.config.learning_rate)
            serving = HeldOutAlpha.of(result["serving"])
            candidate = HeldOutAlpha.of(result["candidate"])
            f = self.figures
            f.rounds += 1
            f.train_seconds = time.monotonic() - started
            f.serving, f.candidate = serving, candidate
            if f.started is None:
                f.started = serving
            decision = judge(serving, candidate, self.config.margin,
                             self.config.min_heldout_positions)
            version = self.versions.record_candidate(
                parent, serving.alpha, candidate.alpha, decision.reason,
                weights=out if decision.swap else None)
            t = result.get("train") or {}
            f.last = (f"{version}: {decision.reason}; trained "
                      f"{'on from the last candidate' if head else f'from {parent}'}: "
                      f"{t.get('steps', '?')} steps, loss {t.get('loss_first', float('nan')):.2f}"
                      f" -> {t.get('loss_last', float('nan')):.2f}")
            log.info("adapt: %s", f.last)
            self._keep_head(parent, out if not decision.swap and progress(serving, candidate)
                            else None)
            if not decision.swap:
                return None
            self.versions.promote(version, decision.reason)
            await self.follow()
            f.serving = f.started = candidate
            return version
        finally:
            shutil.rmtree(out, ignore_errors=True)
            lock.unlink(missing_ok=True)

    # ---- the training head ----------------------------------------------------------

    def head(self, base: str) -> Path | None:
        """The training head on `base`: the latest refused candidate trained
        from it that still did better than it on the held-out slice. The next
        round trains on from there (rounds add up, on a busy draft core each
        gets little CPU); a swap, a rollback or a candidate that did worse
        starts over from the serving weights."""
        path = self.versions.root / f"{HEAD}-{base}"
        return path if (path / "config.json").is_file() else None

    def _keep_head(self, base: str, candidate: Path | None) -> None:
        """Make `candidate` the head on `base` (None: no head); heads on other
        versions go."""
        for old in self.versions.root.glob(f"{HEAD}-*"):
            shutil.rmtree(old, ignore_errors=True)
        if candidate is not None:
            os.replace(candidate, self.versions.root / f"{HEAD}-{base}")

    def _take(self, lock: Path) -> bool:
        """The pool's train lock; one left by a round that died is taken over
        once it is older than two rounds' time."""
        try:
            if lock.exists() and time.time() - lock.stat().st_mtime > 2 * 60 * self.config.train_minutes + 60:
                lock.unlink(missing_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True


async def reload_weights(engine, folder: str) -> None:
    """Load the weights in `folder` into a running vLLM engine in place (between
    two engine steps), and drop its prefix cache (computed with the old ones)."""
    await engine.collective_rpc("reload_weights", kwargs={"weights_path": folder})
    await engine.reset_prefix_cache()
