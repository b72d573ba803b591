"""A stand-in for the target deployment's handle: no Ray, no engine.

`FakeTarget.http` answers like TargetServer.http (start, body chunks, then
{"records": [...], "report": ...}) from a script the test gives; the other methods answer at
once, or never (`hang=True`: no replica up)."""

from __future__ import annotations

import asyncio


class FakeRemote:
    def __init__(self, answer=None, hang=False, error=None):
        self.answer, self.hang, self.error, self.calls = answer, hang, error, 0

    def remote(self, *args):
        self.calls += 1

        async def reply():
            if self.hang:
                await asyncio.sleep(3600)
            if self.error is not None:
                raise self.error
            return self.answer() if callable(self.answer) else self.answer
        return reply()


class FakeStream:
    """Stands in for a streaming DeploymentResponseGenerator."""

    def __init__(self, items, error=None, then=None, hang_after=None):
        self.items = list(items)
        self.error = error  # raised instead of the first item
        self.then = then  # raised after the items (a replica failing mid-answer)
        self.hang_after = hang_after  # this many items, then none ever again (a slow engine)
        self.given = 0
        self.cancelled = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.hang_after is not None and self.given >= self.hang_after:
            await asyncio.sleep(3600)
        self.given += 1
        if self.error is not None:
            raise self.error
        if not self.items:
            if self.then is not None:
                raise self.then
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.cancelled += 1


class FakeHttp:
    def __init__(self, target):
        self.target = target

    def remote(self, *args):
        self.target.calls.append(args)
        return self.target.streams.pop(0)


class FakeTarget:
    def __init__(self, streams=(), ready=True, step_cost=None):
        self.streams = list(streams)
        self.calls: list[tuple] = []
        self.ready = FakeRemote(True, hang=not ready)
        self.spec_totals = FakeRemote(lambda: {"step_cost": step_cost, "draft_tokens": 0})
        self.draft_active = FakeRemote({})
        self.draft_adapt = FakeRemote({})
        self.metrics_report = FakeRemote(lambda: replica_report("t0"))

    def options(self, stream=False):
        assert stream
        return type("Streaming", (), {"http": FakeHttp(self)})()


def replica_report(replica: str, branch_hits: int = 1) -> dict:
    """What TargetServer.metrics_report answers, for a replica that served a little."""
    from specserve.target.engine import SpecTotals

    engine = SpecTotals(num_drafts=2, draft_tokens=8, accepted_tokens=5,
                        accepted_per_position=[2, 1, 1, 1], running=1)
    return {"replica": replica, "model_name": "tiny", "engine": engine.snapshot(),
            "branches": {"same/d0": {"branch_hits": branch_hits}}}


def json_answer(body: bytes, status=200, records=(), report=None):
    return [{"status": status, "headers": [("content-type", "application/json")]},
            body, {"records": list(records), "report": report}]


def sse_answer(events: list[bytes], records=(), report=None):
    return [{"status": 200, "headers": [("content-type", "text/event-stream; charset=utf-8")]},
            *events, {"records": list(records), "report": report}]


class FakeLedger:
    """A handle of deployments.ledger.LedgerServer without Serve: each call's
    arguments and answer are pickled, as Serve copies them between replicas."""

    def __init__(self, server):
        import pickle

        def method(name):
            def remote(*args):
                async def call():
                    copied = pickle.loads(pickle.dumps(args))
                    return pickle.loads(pickle.dumps(await getattr(server, name)(*copied)))
                return call()
            return type("Method", (), {"remote": staticmethod(remote)})()

        self.server = server
        self.add, self.view = method("add"), method("view")
