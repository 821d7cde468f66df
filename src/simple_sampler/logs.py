"""One logging setup for the launcher and every model process.

`simple-sampler serve --log-level` sets it for the launcher and, through
the environment the server's model processes inherit, for each model
(`configure()` in their ``initialize``): lines go to the server's log.
"""
from __future__ import annotations

import logging
import os

#: The variable that carries the level into the model processes.
LOG_LEVEL_ENV = "SIMPLE_SAMPLER_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: HTTP clients whose per-request lines are DEBUG here, not INFO
QUIET_CLIENTS = ("httpx", "httpcore")


def configure(level: str | None = None) -> None:
    """Log at `level` (default: $SIMPLE_SAMPLER_LOG_LEVEL, else INFO)."""
    level = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger().setLevel(level)
    # httpx logs every request it makes at INFO: the front door's /metrics
    # (a Prometheus scrape) would print a line per scrape.
    for name in QUIET_CLIENTS:
        logging.getLogger(name).setLevel(level if level in ("DEBUG", "ERROR") else "WARNING")
