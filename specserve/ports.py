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
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1, free a moment ago.

    All n sockets stay bound until every port is picked: calling free_port()
    n times can hand the same port back twice (the OS reuses a just-closed
    ephemeral port), which made `ray start` refuse two of its agents one port.
    """
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
