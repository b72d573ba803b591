"""vLLM's own OpenAI server app on an engine client, and calling it in-process.

Owns: building vLLM's FastAPI app (`vllm.entrypoints.launchers.app.build_app`
and `init_app_state`, as `vllm serve` and Ray Serve LLM's VLLMEngine do) on a
given engine client, with the engine's own arguments; and `call`, which runs
one HTTP request through an ASGI app without a socket and yields the response
as it is produced (start, then body chunks).

Never does: choose drafts, parse request bodies, or know about Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator


async def build(engine_client, model: str, served_name: str):
    """vLLM's OpenAI app (completions, chat, responses, tokenize, models, ...)
    for the model folder `model`, served as `served_name`, on `engine_client`
    (whose own config is what the serving classes read: context, tokenizer,
    generation defaults)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    # What `vllm serve` parses into one Namespace: frontend flags (defaults),
    # engine flags (the app reads only the model and logging ones).
    args = argparse.Namespace(**(vars(FrontendArgs())
                                 | vars(AsyncEngineArgs(model=model, disable_log_stats=False))))
    args.served_model_name = [served_name]
    tasks = await engine_client.get_supported_tasks()
    app = build_app(args, supported_tasks=tasks, model_config=engine_client.model_config)
    await init_app_state(engine_client, app.state, args, supported_tasks=tasks)
    # vLLM's engine-error handler flips state.server.should_exit (uvicorn's);
    # Serve restarts a replica through check_health instead (as Ray Serve LLM).
    import types

    app.state.server = types.SimpleNamespace()
    return app


def _scope(method: str, path: str, query: str, headers: list[tuple[str, str]]) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
    }


async def call(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
               body: bytes, context: contextvars.Context | None = None
               ) -> AsyncIterator[dict | bytes]:
    """Yield {"status", "headers"} and then the body's chunks (bytes).

    The app runs in its own task, in `context` (default: a copy of this
    one). When the caller
    stops early (closes or cancels this generator: the client went away), the
    app is told the client disconnected and is cancelled, so the engine
    aborts the request."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await out.put(message)

    task = asyncio.get_running_loop().create_task(
        app(_scope(method, path, query, headers), receive, send), context=context)
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                   for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
        task.result()  # an error the app did not turn into a response
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
