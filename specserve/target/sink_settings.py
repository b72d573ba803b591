"""SinkSettings: the draft sink's settings, as one object.

vLLM builds the proposer (and so the sink) itself, in its own worker
processes, which inherit the environment: `TargetEngine.start` writes the
settings into one environment variable (JSON) and the proposer reads them back
in TP rank 0. Pure; never starts anything.
"""

from __future__ import annotations

import dataclasses
import json
import os

from specserve.tls import TlsFiles

ENV = "SPECSERVE_SINK_SETTINGS"


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    address: str  # host:port to listen on (port 0: any free one)
    port_file: str | None = None  # the bound port is written there
    max_pending: int = 64  # drafted tokens buffered per request
    # upper bound of the bounded wait after a rejection with no matching
    # branch (0: never wait; SpeculationConfig.max_wait_ms)
    max_wait_ms: float = 0.0
    # give a request's drafts up after this many steps in a row without any
    # (SpeculationConfig.release_after_steps; 0: never)
    release_after_steps: int = 0
    # one draft stream's messages per second at most (SpeculationConfig's)
    max_stream_messages_per_s: int = 2000
    # propose per request only the drafted tokens that pay (SpeculationConfig's)
    per_request_k: bool = False
    tls: TlsFiles | None = None  # mutual TLS on the sink

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls, environ=os.environ) -> "SinkSettings | None":
        """The settings the engine's starter left (None: no sink wanted)."""
        raw = environ.get(ENV)
        if not raw:
            return None
        d = json.loads(raw)
        tls = d.pop("tls", None)
        if tls and "draft_names" in tls:
            tls["draft_names"] = tuple(tls["draft_names"])
        return cls(**d, tls=TlsFiles(**tls) if tls else None)
