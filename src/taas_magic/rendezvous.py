"""A fresh rendezvous for every run: a free loopback port and a unique run id.

Re-running a cell must never collide with a previous run, so ports recently handed out are
not handed out again (the operating system may offer the same ephemeral port twice in a row).
"""

from __future__ import annotations

import socket
import uuid
from collections import deque

_recent_ports: deque[int] = deque(maxlen=64)


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _recent_ports:
            _recent_ports.append(port)
            return port
    raise OSError(f"no free port on {host} after 100 tries")


def new_run_id() -> str:
    return f"taas-{uuid.uuid4().hex[:12]}"
