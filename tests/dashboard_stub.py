"""A stand-in for the router's ops views: the /dashboard page as shipped and
whatever figures a test writes at /v1/spec/stats and /metrics, for the browser
and Prometheus checks that need no app (tests/deployments/test_dashboard.py)."""

from __future__ import annotations

import http.server
import json
import threading
from importlib.resources import files


class StubStats:
    """The page at /dashboard and whatever `stats` (/v1/spec/stats) and
    `metrics` (/metrics) hold now; `close()` when done."""

    def __init__(self):
        page = files("specserve.dashboard").joinpath("index.html").read_bytes()
        stub = self
        self.stats: dict = {}
        self.metrics = ""

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/dashboard"):
                    body, kind = page, "text/html"
                elif self.path.startswith("/metrics"):
                    body, kind = stub.metrics.encode(), "text/plain; version=0.0.4"
                else:
                    body, kind = json.dumps(stub.stats).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet: the tests read the pages
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
