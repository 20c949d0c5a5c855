"""Ports for the servers the tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(plus: tuple[int, ...] = ()) -> int:
    """A free port on loopback (and port + each of `plus` free too), below
    the kernel's range of source ports for outgoing connections: a port
    from that range could be taken by a connection between now and the
    server's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(12001, low - max(plus, default=0))
    while True:
        port = random.randrange(12000, top)
        try:
            for p in (port, *(port + d for d in plus)):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
