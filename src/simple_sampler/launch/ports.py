"""Loopback ports: free ones for a server to take, and whether one is taken."""
from __future__ import annotations

import socket
from typing import Collection


def free_ports(count: int, taken: Collection[int] = ()) -> list[int]:
    """`count` distinct loopback ports free now, none of them in `taken`.
    Each probe stays bound until all are chosen: probes bound and closed one
    at a time can be given the same port twice (it happened: Triton then
    refused an HTTP port equal to its metrics port)."""
    probes, ports = [], []
    try:
        while len(ports) < count:
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            if port not in taken:
                ports.append(port)
    finally:
        for probe in probes:
            probe.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False
