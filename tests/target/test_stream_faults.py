"""The draft -> target stream under trouble, against a live target engine, over
mutual TLS (draft = target, so every draft that arrives in time is accepted).

- Over TLS the drafts arrive and are accepted; a draft with a certificate from
  another CA is refused by the handshake; the output is the target-only output.
- Through a proxy that delays every chunk and cuts every connection
  periodically (the link reconnects and re-opens its requests), the output is
  unchanged, and drafts are still accepted between the cuts.
"""

import asyncio
import os
import random
import threading

import grpc
import pytest

from conftest import PROMPTS, SLOW_TARGET_ENV, Loop
from specserve.engine import EngineSettings
from specserve.local import LocalSpec, run_prompts, sampling_params
from specserve.testing.certs import SERVER_NAME, make_pki
from specserve.tls import TlsFiles, channel_credentials
from specserve.v1 import spec_pb2, spec_pb2_grpc

pytestmark = pytest.mark.slow

LONG = 128  # tokens per request: several connection cuts happen during a run


class TroubleProxy:
    """A TCP proxy on its own thread: delays each chunk by up to `max_delay_s`
    and, while `cutting`, closes every connection every `cut_every_s`."""

    def __init__(self, upstream: str, max_delay_s=0.02, cut_every_s=0.8, seed=0):
        self.host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.max_delay_s, self.cut_every_s = max_delay_s, cut_every_s
        self.rng = random.Random(seed)
        self.connections = 0
        self.cuts = 0
        self.cutting = False
        self._writers: set = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.address = f"127.0.0.1:{self.port}"

    def _main(self, ready):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.loop.create_task(self._cutter())
        ready.set()
        self.loop.run_forever()

    async def _client(self, reader, writer):
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pipe(self, reader, writer):
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def _cutter(self):
        while True:
            await asyncio.sleep(self.cut_every_s)
            if self.cutting and self._writers:
                self.cuts += 1
                for w in list(self._writers):
                    w.transport.abort()

    async def _shutdown(self):
        for w in list(self._writers):
            w.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self):
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    """A LocalSpec with draft = target over mutual TLS, and the long reference."""
    from transformers import AutoTokenizer

    from specserve.testing.tiny import greedy_reference

    target = str(tiny_models["target"])
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    tls = TlsFiles(pki["ca"], pki["server_cert"], pki["server_key"], SERVER_NAME)
    os.environ.update(SLOW_TARGET_ENV)
    loop = Loop()
    spec = LocalSpec(target, target, k=4, lookahead=8,
                     settings=EngineSettings(dtype="float32", kv_cache_gib=1), tls=tls)
    try:
        loop.run(spec.__aenter__())
        yield {"spec": spec, "loop": loop, "pki": pki, "tok": AutoTokenizer.from_pretrained(target),
               "reference": greedy_reference(target, PROMPTS, LONG)}
    finally:
        loop.run(spec.aclose())
        loop.close()
        for var in SLOW_TARGET_ENV:
            os.environ.pop(var, None)


def generate(s):
    outs = s["loop"].run(run_prompts(s["spec"], s["tok"], PROMPTS,
                                     sampling_params(LONG, 0.0, True)))
    return [o.token_ids for o in outs]


def test_drafts_over_mutual_tls_are_accepted_and_a_rogue_draft_is_refused(setup):
    spec = setup["spec"]
    # A draft with a certificate from another CA cannot even open a stream.
    rogue = TlsFiles(setup["pki"]["ca"], setup["pki"]["rogue_cert"], setup["pki"]["rogue_key"])
    channel = grpc.secure_channel(spec.sink_address, channel_credentials(rogue),
                                  options=[("grpc.ssl_target_name_override", SERVER_NAME)])
    call = spec_pb2_grpc.DraftSinkStub(channel).Connect(iter([spec_pb2.DraftMessage(
        open=spec_pb2.OpenRequest(request_id="rogue", ticket="guess"))]))
    with pytest.raises(grpc.RpcError) as refused:
        list(call)
    channel.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    before = spec.totals.accepted_tokens
    assert generate(setup) == setup["reference"]
    assert spec.totals.accepted_tokens - before > 50, spec.totals  # the TLS draft fed it


def test_delays_cuts_and_reconnects_change_no_output(setup):
    spec = setup["spec"]
    direct = spec.sink_address
    proxy = TroubleProxy(direct)
    spec.sink_address = proxy.address  # the draft reaches the sink only through the proxy
    try:
        proxy.cutting = True
        before = spec.totals.accepted_tokens
        for _ in range(2):
            assert generate(setup) == setup["reference"]
        # The stream really was cut and re-established, and drafts kept coming.
        print(f"proxy: {proxy.connections} connections, {proxy.cuts} cuts; accepted "
              f"{spec.totals.accepted_tokens - before} drafted tokens while cutting")
        assert proxy.cuts >= 3 and proxy.connections >= 3, (proxy.cuts, proxy.connections)
        assert spec.totals.accepted_tokens > before, spec.totals
    finally:
        spec.sink_address = direct
        proxy.close()
