"""The router's HTTP outcomes: responses by route and status, aborts, streams
the target failed mid-way, requests in flight.

Owns the counting and its /metrics families (catalogued in
`specserve.acceptance.catalogue`). Routes are the router's own (a bounded
set); any other path counts as "other". Pure: the router calls `started`,
`responded` and `ended` (once per request, however it ends).
"""

from __future__ import annotations

from collections import Counter

from specserve.acceptance.exposition import family

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
          "/detokenize", "/healthz", "/metrics", "/v1/spec/stats", "/dashboard")


def route_label(path: str) -> str:
    path = path.rstrip("/") or "/"
    return path if path in ROUTES else "other"


class HttpOutcomes:
    def __init__(self):
        self.responses: Counter = Counter()  # (route, status) -> responses
        self.aborts: Counter = Counter()  # route -> responses the client left
        self.stream_failures: Counter = Counter()  # route -> streams the target failed
        self.inflight: Counter = Counter()  # route -> requests not yet ended

    def started(self, route: str) -> None:
        self.inflight[route] += 1

    def responded(self, route: str, status: int) -> None:
        """The response's status is known (its start was sent or is about to be)."""
        self.responses[(route, str(status))] += 1

    def stream_failed(self, route: str) -> None:
        self.stream_failures[route] += 1

    def ended(self, route: str, aborted: bool = False) -> None:
        """aborted: the client went away before the response's end."""
        self.inflight[route] -= 1
        if aborted:
            self.aborts[route] += 1

    def prometheus_lines(self) -> list[str]:
        return [
            *family("specserve_http_responses_total",
                    [({"route": r, "status": s}, n)
                     for (r, s), n in sorted(self.responses.items())]),
            *family("specserve_http_aborts_total",
                    [({"route": r}, n) for r, n in sorted(self.aborts.items())]),
            *family("specserve_http_stream_failures_total",
                    [({"route": r}, n) for r, n in sorted(self.stream_failures.items())]),
            *family("specserve_http_inflight",
                    [({"route": r}, n) for r, n in sorted(self.inflight.items())]),
        ]
