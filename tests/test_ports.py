"""`verl_speco.ports.free_port`: the port it names is one a server can bind at once, and it is not one
already taken; it imports nothing beyond the standard library (tests and launchers call it without Ray)."""

from __future__ import annotations

import socket
import subprocess
import sys

from verl_speco.ports import free_port


def test_the_port_is_free_and_usable_on_the_host() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = {free_port("127.0.0.1") for _ in range(4)}
        assert busy not in ports  # the OS never hands out a port a listening socket holds
    for port in ports:
        assert 1024 <= port <= 65535
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))  # raises OSError if the port were in use
            server.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass


def test_importing_it_loads_no_ray() -> None:
    code = "import sys, verl_speco.ports; print('ray' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
