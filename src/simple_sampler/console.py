"""The `simple-sampler` command: SIGINT and SIGTERM are noted from its first
line, before the package's heavy imports (numpy, the kernels, torch), so a
Ctrl-C while Python is still importing is never lost in an import's except
clause. A signal before the command starts anything ends it with 128 + the
signal's number; `serve` takes over the noting handler (launch/serve.py
`run` reads its `received`), so one that arrives while `serve` parses its
options still stops it cleanly."""
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class NotedSignals:
    """A signal handler that only records what arrived."""

    def __init__(self):
        self.received: list[int] = []

    def __call__(self, signum, _frame):
        self.received.append(signum)


def main() -> int:
    noted = NotedSignals()
    previous = {s: signal.signal(s, noted) for s in STOP_SIGNALS}
    from .cli import main as cli_main

    if noted.received:
        return 128 + noted.received[0]
    if sys.argv[1:2] != ["serve"]:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
