"""Checking that the stack's ports are free before anything starts, so a clash is one clear line."""
from __future__ import annotations

import socket


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Like the servers will: a port in TIME_WAIT is reusable, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def busy_ports(host: str, ports: list[int]) -> list[int]:
    return [port for port in ports if not port_is_free(host, port)]
