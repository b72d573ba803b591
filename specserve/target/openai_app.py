"""vLLM's own OpenAI server app on an engine client, and calling it in-process.

Owns: building vLLM's FastAPI app (`vllm.entrypoints.launchers.app.build_app`
and `init_app_state`, as `vllm serve` and Ray Serve LLM's VLLMEngine do) on a
given engine client, with the engine's own arguments and the tool-call
parser of specserve's config; `RequestGate`, the 400 for request fields
vLLM's request classes lack (vLLM's server drops them with a debug log line;
OpenAI's API answers 400) and for bodies over the quotas
(`specserve.target.quotas.body_problem`: n, best_of, max_tokens); `config_hint`, which names specserve's config
where vLLM's error messages name `vllm serve` flags; and `call`, which runs
one HTTP request through an ASGI app without a socket and yields the response
as it is produced (start, then body chunks).

Never does: choose drafts, read request fields beyond their names (vLLM's
request classes parse and validate them), or know about Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import re
from collections.abc import AsyncIterator


async def build(engine_client, model: str, served_name: str,
                tool_call_parser: str | None = None, quotas=None):
    """vLLM's OpenAI app (completions, chat, responses, tokenize, models, ...)
    for the model folder `model`, served as `served_name`, on `engine_client`
    (whose own config is what the serving classes read: context, tokenizer,
    generation defaults). tool_call_parser: vLLM's parser of the model's tool
    calls (`vllm serve --enable-auto-tool-choice --tool-call-parser NAME`);
    None: a chat request with tools and a tool_choice other than "none" gets
    vLLM's 400 (see `config_hint`). quotas: a callable returning the
    QuotaConfig now (it may change while the app runs); None: no quotas."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    # What `vllm serve` parses into one Namespace: frontend flags (defaults),
    # engine flags (the app reads only the model and logging ones).
    args = argparse.Namespace(**(vars(FrontendArgs())
                                 | vars(AsyncEngineArgs(model=model, disable_log_stats=False))))
    args.served_model_name = [served_name]
    args.enable_auto_tool_choice = tool_call_parser is not None
    args.tool_call_parser = tool_call_parser
    tasks = await engine_client.get_supported_tasks()
    app = build_app(args, supported_tasks=tasks, model_config=engine_client.model_config)
    await init_app_state(engine_client, app.state, args, supported_tasks=tasks)
    # vLLM's engine-error handler flips state.server.should_exit (uvicorn's);
    # Serve restarts a replica through check_health instead (as Ray Serve LLM).
    import types

    app.state.server = types.SimpleNamespace()
    return RequestGate(app, request_fields(app), quotas)


def request_fields(app) -> dict[str, frozenset[str]]:
    """Path -> the fields (names and aliases) of the request class of each POST
    route of `app` whose JSON body is a pydantic class (vLLM's own, e.g.
    CompletionRequest; for a union of classes, the fields of any of them)."""
    import typing

    from fastapi.routing import APIRoute

    fields = {}
    for route in app.routes:
        if isinstance(route, APIRoute) and "POST" in route.methods and route.body_field:
            annotation = route.body_field.field_info.annotation
            classes = [c for c in typing.get_args(annotation) or (annotation,)
                       if hasattr(c, "model_fields")]
            if classes:
                fields[route.path] = frozenset().union(*map(field_names, classes))
    return fields


def field_names(request_class) -> set[str]:
    """A pydantic class's field names and their aliases."""
    names = set()
    for name, field in request_class.model_fields.items():
        names.add(name)
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
            elif alias is not None:  # AliasChoices
                names.update(c for c in getattr(alias, "choices", ()) if isinstance(c, str))
    return names


def unknown_fields(known: frozenset[str] | set[str], body: dict) -> list[str]:
    """The top-level keys of `body` not in `known`, sorted."""
    return sorted(body.keys() - known)


def unknown_fields_error(fields: list[str]) -> str:
    """The 400's message: OpenAI's wording, with what to send instead where
    vLLM names it (its removed guided-decoding fields)."""
    message = f"Unrecognized request argument supplied: {', '.join(fields)}"
    if any(f.startswith("guided_") for f in fields):
        message += (" (vLLM removed its guided_* fields; use structured_outputs or "
                    "response_format)")
    return message


class RequestGate:
    """ASGI wrapper of vLLM's app: a POST whose JSON object body has a key its
    route's request class lacks gets vLLM's 400 error body naming the keys,
    instead of vLLM's answer to the request without them; one over the
    quotas (`quotas()`, see `specserve.target.quotas.body_problem`) gets a
    400 naming the field and the limit. Anything else (other routes, bodies
    that are not a JSON object) goes to vLLM as it came."""

    def __init__(self, app, fields: dict[str, frozenset[str]], quotas=None):
        self.app = app
        self.fields = fields  # request_fields(app)
        self.quotas = quotas  # () -> QuotaConfig, or None

    async def __call__(self, scope, receive, send):
        known = (self.fields.get(scope.get("path"))
                 if scope["type"] == "http" and scope["method"] == "POST" else None)
        if known is None:
            return await self.app(scope, receive, send)
        messages, body = [], bytearray()
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body") or b""
            if not message.get("more_body"):
                break
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):  # vLLM's parser answers it
            parsed = None
        problem = self._problem(known, parsed) if isinstance(parsed, dict) else None
        if problem is not None:
            from starlette.responses import JSONResponse
            from vllm.entrypoints.serve.exception_handling.error_response import (
                create_error_response,
            )

            field, message = problem
            error = create_error_response(message, param=field)
            return await JSONResponse(error.model_dump(), status_code=400)(scope, receive, send)
        replay = iter(messages)

        async def receive_again():
            return next(replay, None) or await receive()

        return await self.app(scope, receive_again, send)

    def _problem(self, known: frozenset[str], body: dict) -> tuple[str, str] | None:
        """(field, message) of the 400 for `body`, or None."""
        fields = unknown_fields(known, body)
        if fields:
            return fields[0], unknown_fields_error(fields)
        if self.quotas is not None:
            from specserve.target.quotas import body_problem

            return body_problem(body, self.quotas())
        return None


def check_tool_call_parser(name: str | None) -> None:
    """ValueError unless `name` is None or one of vLLM's registered tool-call parsers."""
    if name is None:
        return
    from vllm.tool_parsers import ToolParserManager

    known = sorted(ToolParserManager.list_registered())
    if name not in known:
        raise ValueError(f"target.tool_call_parser {name!r} is not one of vLLM's tool-call "
                         f"parsers: {', '.join(known)}")


# vLLM's messages that name its own command-line flags, and what sets the same
# thing in specserve's config.
_FLAG_HINTS = [
    (re.compile(r"--enable-auto-tool-choice and --tool-call-parser to be set"
                r"|--tool-call-parser to be set"),
     "target.tool_call_parser to be set in specserve's config (vLLM's "
     "--enable-auto-tool-choice --tool-call-parser)"),
]


def config_hint(body: bytes) -> bytes:
    """An error body of vLLM's with its `vllm serve` flags named as specserve's
    config fields (the body is otherwise unchanged)."""
    text = body.decode("utf-8", "replace")
    for pattern, hint in _FLAG_HINTS:
        text = pattern.sub(hint, text)
    return text.encode()


# How long an app told that the client went away may take to end before its
# task is cancelled (vLLM's handlers abort their engine requests at once).
DISCONNECT_GRACE_S = 5.0


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
    """Yield {"status", "headers"} and then the body's chunks (bytes; chunks
    that queued up while the caller was busy are joined into one).

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
        held: list = []  # a message taken from the queue but not yet handled
        while True:
            message = held.pop() if held else await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                   for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                # Body chunks the app produced while the last one was on its
                # way go on as one (fewer items through Serve's hops under load).
                chunk = bytearray(message.get("body") or b"")
                while not out.empty():
                    more = out.get_nowait()
                    if more is None or more["type"] != "http.response.body":
                        held.append(more)
                        break
                    chunk += more.get("body") or b""
                if chunk:
                    yield bytes(chunk)
        task.result()  # an error the app did not turn into a response
    finally:
        # The app is told first: vLLM's non-streaming handlers (with_cancellation)
        # run in a task of their own, which a cancelled app task leaves running
        # (and its engine request with it); on the disconnect they cancel it,
        # so the engine aborts the request. Cancelled only if it does not end.
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
