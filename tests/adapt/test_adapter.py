"""The draft adapter end to end on a tiny draft (training in this process):
a buffer of one domain trains a candidate the guard lets serve and the engine
loads; a poisoned buffer never swaps; every replica follows the pool's version
(rollbacks too); one replica of a pool trains at a time."""

from __future__ import annotations

import asyncio
import random

from adapt_models import VOCAB, pattern_examples
from specserve.adapt.adapter import LOCK, DraftAdapter, cores
from specserve.adapt.buffer import AdaptBuffer
from specserve.adapt.versions import SHIPPED, VersionStore
from specserve.config.adapt import AdaptConfig


def config(tmp_path, **kw) -> AdaptConfig:
    base = dict(enabled=True, buffer_tokens=100_000, max_context_tokens=6, per_request_tokens=64,
                heldout_share=0.3, min_heldout_positions=100, margin=0.05,
                train_every_minutes=30, train_minutes=0.2, learning_rate=1e-2,
                versions_dir=str(tmp_path / "versions"))
    return AdaptConfig(**(base | kw))


def fill(buffer: AdaptBuffer, pairs) -> None:
    for i, (context, continuation) in enumerate(pairs):
        rid = f"req-{i}"
        buffer.open(rid, context)
        buffer.observe(rid, context + continuation)
        buffer.close(rid)


class Engine:
    """Stands in for the draft engine: what was loaded, in order."""

    def __init__(self):
        self.loaded: list[str] = []

    async def load(self, folder: str) -> None:
        self.loaded.append(folder)


def adapter(cfg, tiny_draft, engine, buffer=None, store=None) -> DraftAdapter:
    buffer = buffer or AdaptBuffer.from_config(cfg)
    store = store or VersionStore(cfg.versions_root("pool"), source=str(tiny_draft))
    return DraftAdapter(cfg, buffer, store, str(tiny_draft), engine.load,
                        run=lambda fn, *args: asyncio.to_thread(fn, *args))


def test_a_round_on_one_domain_trains_a_candidate_that_serves(tiny_draft, tmp_path):
    cfg = config(tmp_path)
    engine = Engine()
    a = adapter(cfg, tiny_draft, engine)
    fill(a.buffer, pattern_examples(80, seed=1))
    assert a.buffer.heldout_positions >= cfg.min_heldout_positions
    version = asyncio.run(a.round())
    f = a.figures
    assert version == "v1", f.last
    (record,) = [v for v in a.versions.versions() if v["version"] == "v1"]
    # measured on one held-out slice: the serving weights, then the candidate
    assert record["alpha_after"] > record["alpha_before"] + cfg.margin
    assert record["alpha_after"] == f.candidate.alpha
    assert f.serving == f.candidate  # the candidate serves now
    assert a.versions.current() == "v1" and a.loaded == "v1"
    assert engine.loaded == [str(a.versions.path("v1"))]
    assert (a.versions.path("v1") / "config.json").is_file()
    assert not (a.versions.root / LOCK).exists()


def test_a_poisoned_buffer_never_leads_to_a_swap(tiny_draft, tmp_path):
    cfg = config(tmp_path)
    engine = Engine()
    a = adapter(cfg, tiny_draft, engine)
    rng = random.Random(3)
    fill(a.buffer, [([rng.randrange(3, VOCAB) for _ in range(6)],
                     [rng.randrange(3, VOCAB) for _ in range(12)]) for _ in range(80)])
    assert asyncio.run(a.round()) is None
    assert a.versions.current() == SHIPPED and engine.loaded == []
    (record,) = [v for v in a.versions.versions() if v["version"] == "v1"]
    assert record["state"] == "candidate" and record["reason"].startswith("refused")
    assert not any(a.versions.path("v1").iterdir())  # a refused candidate's weights go
    assert a.figures.last.startswith("v1: refused")


def test_too_little_held_out_data_trains_nothing(tiny_draft, tmp_path):
    cfg = config(tmp_path, min_heldout_positions=10_000)
    a = adapter(cfg, tiny_draft, Engine())
    fill(a.buffer, pattern_examples(20, seed=2))
    assert asyncio.run(a.round()) is None
    assert "waiting for held-out data" in a.figures.last
    assert [v["version"] for v in a.versions.versions()] == [SHIPPED]


def test_every_replica_follows_the_pools_version_and_its_rollbacks(tiny_draft, tmp_path):
    cfg = config(tmp_path)
    first, second = Engine(), Engine()
    a = adapter(cfg, tiny_draft, first)
    b = adapter(cfg, tiny_draft, second, store=VersionStore(cfg.versions_root("pool")))
    v1 = a.versions.record_candidate(SHIPPED, 0.1, 0.5, "swap: by hand")
    a.versions.promote(v1)
    assert asyncio.run(b.follow()) and second.loaded == [str(b.versions.path(v1))]
    assert not asyncio.run(b.follow())  # already serving it
    a.versions.rollback("by hand")
    assert asyncio.run(b.follow()) and second.loaded[-1] == str(tiny_draft)  # v0: the shipped


def test_refused_rounds_that_progress_add_up_and_a_worse_one_starts_over(tiny_draft, tmp_path):
    """A refused candidate that did no worse than the serving weights is the
    training head: the next round trains on from it (on a busy draft core one
    round gets little CPU); one that did worse starts over from the serving
    weights. Training stands in: each round's alphas are given."""
    import shutil

    cfg = config(tmp_path, margin=0.1)
    outcomes = iter([((30, 100), (35, 100)), ((30, 100), (38, 100)), ((30, 100), (20, 100)),
                     ((30, 100), (31, 100))])
    starts = []

    async def run(fn, serving_folder, start, train, heldout, out, *rest):
        starts.append(start)
        shutil.copytree(tiny_draft, out)
        serving, candidate = next(outcomes)
        return {"serving": serving, "candidate": candidate,
                "train": {"steps": 3, "loss_first": 5.0, "loss_last": 4.0}}

    a = DraftAdapter(cfg, AdaptBuffer.from_config(cfg),
                     VersionStore(cfg.versions_root("pool"), source=str(tiny_draft)),
                     str(tiny_draft), Engine().load, run=run)
    fill(a.buffer, pattern_examples(80, seed=1))
    head = a.versions.root / ".head-v0"
    assert asyncio.run(a.round()) is None  # 0.35 is not 0.30 + 0.1: refused, but progress
    assert a.head("v0") == head and "trained from v0: 3 steps, loss 5.00 -> 4.00" in a.figures.last
    assert asyncio.run(a.round()) is None  # trained on from the head
    assert "trained on from the last candidate" in a.figures.last and a.head("v0") == head
    assert asyncio.run(a.round()) is None  # worse than serving: the head goes
    assert a.head("v0") is None
    asyncio.run(a.round())  # from the serving weights again
    assert starts == [str(tiny_draft), str(head), str(head), str(tiny_draft)]
    assert a.versions.current() == SHIPPED
    assert [v["state"] for v in a.versions.versions()[1:]] == ["candidate"] * 4
    assert not list(a.versions.root.glob(".candidate-*"))


def test_a_round_without_enough_data_stays_due(tiny_draft, tmp_path):
    now = [0.0]
    cfg = config(tmp_path, train_every_minutes=10)
    a = DraftAdapter(cfg, AdaptBuffer.from_config(cfg),
                     VersionStore(cfg.versions_root("pool"), source=str(tiny_draft)),
                     str(tiny_draft), Engine().load, clock=lambda: now[0],
                     run=lambda fn, *args: asyncio.to_thread(fn, *args))
    now[0] = 600.0
    assert a.due() and asyncio.run(a.round()) is None
    assert a.figures.last.startswith("waiting for held-out data") and a.due()


def test_one_replica_of_a_pool_trains_at_a_time(tiny_draft, tmp_path):
    cfg = config(tmp_path)
    a = adapter(cfg, tiny_draft, Engine())
    fill(a.buffer, pattern_examples(80, seed=1))
    (a.versions.root / LOCK).write_text("another replica")
    assert asyncio.run(a.round()) is None
    assert a.figures.last == "another replica of the pool is training"
    assert (a.versions.root / LOCK).read_text() == "another replica"  # not ours to remove


def test_the_schedule_and_the_drop_trigger():
    now = [0.0]
    cfg = AdaptConfig(enabled=True, train_every_minutes=10, train_minutes=1,
                      alpha_drop_trigger=0.05, min_heldout_positions=1000)
    a = DraftAdapter(cfg, AdaptBuffer.from_config(cfg), store_stub(), "src", None,
                     clock=lambda: now[0])
    assert not a.due()
    now[0] = 599.0
    assert not a.due() and a.check_due()  # every sixth of the schedule: measure
    from specserve.adapt.guard import HeldOutAlpha
    a.figures.started = HeldOutAlpha(500, 1000)
    a.figures.serving = HeldOutAlpha(440, 1000)  # 0.44 < 0.50 - 0.05
    assert a.due()
    a.figures.serving = HeldOutAlpha(460, 1000)
    assert not a.due()
    now[0] = 600.0
    assert a.due()


def store_stub():
    class Store:
        root = None

        def current(self):
            return SHIPPED
    return Store()


def test_cores_of_an_openmp_list():
    assert cores("1") == [1] and cores("2-3") == [2, 3] and cores("0,2-3") == [0, 2, 3]
    assert cores(None) == [] and cores("") == []


def test_a_replica_that_goes_stops_its_round_and_frees_the_lock(tiny_draft, tmp_path):
    """DraftServer.__del__ -> abandon(): the training process is killed (a pool
    shutdown alone lets a running round finish) and the pool's train lock goes
    now, not when it expires; another replica's lock stays."""
    import time

    cfg = config(tmp_path)
    a = DraftAdapter(cfg, AdaptBuffer.from_config(cfg),
                     VersionStore(cfg.versions_root("pool"), source=str(tiny_draft)),
                     str(tiny_draft), Engine().load)
    lock = a.versions.root / LOCK

    async def go():
        assert a._take(lock)
        sleeping = asyncio.ensure_future(a._in_training_process(time.sleep, 600))
        while a._pool is None or not a._pool._processes:
            await asyncio.sleep(0.05)
        (process,) = a._pool._processes.values()
        a.abandon()
        process.join(30)
        assert process.exitcode is not None  # killed, not left to sleep 600 s
        assert not lock.exists() and a._pool is None
        sleeping.cancel()
        await asyncio.gather(sleeping, return_exceptions=True)

    asyncio.run(go())
    lock.write_text("another replica")
    a.abandon()
    assert lock.read_text() == "another replica"
