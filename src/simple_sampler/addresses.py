"""Where the servers listen and sample: ports and sampler endpoints, checked.

The settings (settings.py) and the launcher read them; nothing heavy is
imported here.
"""
from __future__ import annotations

import re

#: The local instances' name in a list of sampler endpoints.
LOCAL = "local"

#: A port as the servers' options and the sampler endpoints take it.
PORT_RANGE = (1, 65535)
#: host:port of a sampler endpoint: a name or IPv4 address, or an IPv6
#: address in brackets (as gRPC writes one), then a port in ASCII digits
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]+)", re.ASCII)


def parse_endpoints(text: str) -> list[str]:
    """'local,host:port,...' -> the names, checked; "" means local only."""
    names = [name.strip() for name in text.split(",") if name.strip()] or [LOCAL]
    places = []
    for name in names:
        match = _ENDPOINT.fullmatch(name)
        if name != LOCAL and not (match and PORT_RANGE[0] <= int(match[2]) <= PORT_RANGE[1]):
            raise ValueError(f"sampler_endpoints must be '{LOCAL}' or host:port entries (an "
                             f"IPv6 host in brackets, a port in [{PORT_RANGE[0]}, "
                             f"{PORT_RANGE[1]}]), got {name!r}")
        places.append(name if name == LOCAL else (match[1].lower(), int(match[2])))
    if len(set(places)) != len(places):
        raise ValueError(f"sampler_endpoints lists an entry twice: {text!r}")
    return names


def check_distinct_ports(**ports: int) -> None:
    """Raise ValueError naming two of `ports` (name -> port; 0: off) that are one."""
    taken: dict[int, str] = {}
    for name, port in ports.items():
        if port and port in taken:
            raise ValueError(f"{name} and {taken[port]} are both {port}: each needs a port "
                             f"of its own")
        taken.setdefault(port, name)
