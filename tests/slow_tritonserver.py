"""A stand-in for tritonserver in tests/test_startup.py: answers Triton's
readiness and repository-index endpoints on --http-port, reporting the llm
model LOADING for $READY_AFTER_S seconds (an engine build), then READY, and
an empty /metrics on --metrics-port and a listening --grpc-port (TritonServer
waits for every endpoint)."""
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

READY_AT = time.monotonic() + float(os.environ.get("READY_AFTER_S", "0"))
PORTS = {a.split("=", 1)[0]: int(a.split("=", 1)[1]) for a in sys.argv[1:]
         if a.startswith(("--http-port=", "--metrics-port=", "--grpc-port="))}


class Handler(BaseHTTPRequestHandler):
    def _reply(self, status, body=b""):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # /v2/health/ready
        self._reply(200 if time.monotonic() >= READY_AT else 503)

    def do_POST(self):  # /v2/repository/index
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        state = "READY" if time.monotonic() >= READY_AT else "LOADING"
        self._reply(200, json.dumps([{"name": "llm", "version": "1", "state": state}]).encode())

    def log_message(self, *args):
        pass


class Metrics(Handler):
    def do_GET(self):  # /metrics
        self._reply(200)


def install(directory):
    """A TritonInstall in `directory` whose 'tritonserver' is this stand-in
    (its llm model loads for $READY_AFTER_S seconds)."""
    from simple_sampler.launch.install import TritonInstall

    backend = directory / "python"
    backend.mkdir()
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (backend / name).write_text("")
    server = directory / "tritonserver"
    server.write_text(f"#!/bin/sh\nexec {sys.executable} {__file__} \"$@\"\n")
    server.chmod(0o755)
    return TritonInstall(server, (), backend, backend / "libtriton_python.so")


if __name__ == "__main__":
    grpc = socket.create_server(("127.0.0.1", PORTS["--grpc-port"]))  # accepts, never answers
    metrics = HTTPServer(("127.0.0.1", PORTS["--metrics-port"]), Metrics)
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    HTTPServer(("127.0.0.1", PORTS["--http-port"]), Handler).serve_forever()
