"""A free TCP port from the operating system: for a process-group rendezvous or a test server.

Standard library only, so a caller (a test, a light launcher) gets a port without importing Ray.
The probing socket closes before the port is returned, so another process may take it in between:
use the port at once.
"""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` ("" binds every interface) at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
