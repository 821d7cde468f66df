"""What ``serve`` prints while it waits for Triton to become ready (how long
it waits is the engine's, ``serving.engines``)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

PROGRESS_S = 30.0  # seconds between progress lines while the server loads


class StartInterrupted(Exception):
    """The launcher was asked to stop while the server was starting."""


def model_states(http_url: str) -> str:
    """``name STATE`` per model from Triton's repository index (POST
    /v2/repository/index), e.g. ``llm LOADING, simple_sampler READY``; empty
    while the server does not answer."""
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}",
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            models = json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return ""
    return ", ".join(f"{m.get('name')} {m.get('state', '?')}" for m in models)


def progress_line(elapsed_s: float, timeout_s: float, states: str) -> str:
    return (f"simple-sampler serve: waiting for tritonserver, {elapsed_s:.0f} s of "
            f"{timeout_s:.0f} s (--startup-timeout): {states or 'not answering yet'}")
