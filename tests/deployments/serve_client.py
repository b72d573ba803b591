"""A client of a Serve app started by `specserve serve` (tests/deployments):
completions streamed over http.client (the test decides when to hang up),
/v1/spec/stats, the app's replica processes (and a replica's engine core) and
SIGKILLs of them, and the thread and wait helpers the fault tests share
(test_reliability.py, test_many_replicas.py). The model is served as "tiny"."""

import http.client
import json
import os
import signal
import threading
import time

import psutil

from specserve.tools.serveproc import get

def body(prompt, max_tokens, stream=True):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def open_stream(app, prompt, max_tokens, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body(prompt, max_tokens)),
                 {"Content-Type": "application/json"})
    return conn


def events(response):
    """Parsed SSE data events until [DONE] (yields the string "[DONE]" last)."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)
        if data == "[DONE]":
            return


def read_stream(app, prompt, max_tokens, timeout=120, started=None):
    """(text, error or None, saw [DONE]) of one streamed completion; sets the
    threading.Event `started`, if given, when the first text arrives."""
    conn = open_stream(app, prompt, max_tokens, timeout)
    try:
        r = conn.getresponse()
        if r.status != 200:
            return "", {"status": r.status, "body": r.read().decode()}, False
        text, error, done = "", None, False
        for ev in events(r):
            if ev == "[DONE]":
                done = True
            elif "error" in ev:
                error = ev["error"]
            else:
                text += ev["choices"][0]["text"]
                if started is not None:
                    started.set()
        return text, error, done
    finally:
        conn.close()


def stats(app):
    status, s = get(f"{app.url}/v1/spec/stats", timeout=60)
    assert status == 200, s
    return s


def replica_processes(app, name):
    """The Serve replica processes of deployment `name` (e.g. "target", "draft-same")."""
    found = []
    for p in psutil.Process(app.proc.pid).children(recursive=True):
        try:
            if f"ServeReplica:specserve:{name}" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def engine_core(replica: psutil.Process) -> psutil.Process | None:
    """A Serve replica's vLLM engine core: its one child that is not
    multiprocessing's resource tracker (the engine's workers are the core's
    children). Found by place, not by title: vLLM titles it VLLM::EngineCore,
    but CI has twice listed a serving engine's processes as plain `python`.
    None while the replica has no such child, or more than one."""
    cores = []
    try:
        for p in replica.children():
            try:
                if "resource_tracker" not in " ".join(p.cmdline()):
                    cores.append(p)
            except psutil.Error:  # gone meanwhile
                continue
    except psutil.Error:  # the replica is gone
        return None
    return cores[0] if len(cores) == 1 else None


def kill_replica(app, name, replica=None):
    """SIGKILL a deployment's replica (the only one, or `replica`, a process of
    replica_processes) and the engine processes under it (as when its container
    or node dies). Returns once the signals are sent, not once the processes
    are gone, so the streams a test kills them under still run."""
    if replica is None:
        [replica] = replica_processes(app, name)
    for p in [replica] + replica.children(recursive=True):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout, what, interval=1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout}s: {what}")


def start_streams(app, prompts, max_tokens, timeout=120):
    """Streams on threads, returned (threads, results) once each has sent text,
    so a fault injected next lands mid-stream on any machine (a fixed sleep
    did not: on a fast one the streams had ended, on a slow one not begun)."""
    started = [threading.Event() for _ in prompts]
    threads, results = in_threads(read_stream, [(app, p, max_tokens, timeout, e)
                                                for p, e in zip(prompts, started)])
    deadline = time.monotonic() + timeout
    for e in started:
        assert e.wait(max(0.0, deadline - time.monotonic())), "a stream sent no text"
    return threads, results


def in_threads(fn, args_list):
    """Run fn(*args) for each args on threads; returns (threads, results dict)."""
    results = {}

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001  (recorded, asserted by the caller)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, a), daemon=True)
               for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results
