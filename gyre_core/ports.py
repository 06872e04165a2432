"""A port for a server Gyre starts on loopback (a vLLM server, the temporary Prefect server, a stack).

    port = free_port()          # then start the server on 127.0.0.1:port
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` now (nothing holds it for the caller: start the server soon)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
