"""A free TCP port from the operating system (standard library only, no Ray); the probing socket closes
before it is returned, so use it at once."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` ("" binds every interface) at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
