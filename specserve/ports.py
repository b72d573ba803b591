"""Local TCP ports: the one helper that picks a free one.

Used where a process must be told a port before it binds it (the draft
process's control port in LocalSpec, `specserve serve` started by
`specserve.tools.serveproc`). A port is free when picked, not reserved: the
caller binds it soon after.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
