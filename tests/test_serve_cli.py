"""`simple-sampler serve` as a user runs it: starts, answers, stops on
SIGINT with status 0; the errors a user can hit get one clear line each."""
import os
import signal
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from simple_sampler.launch import install
from simple_sampler.triton.sampler_client import SamplerClient
from simple_sampler.launch.ports import free_port, free_ports
from simple_sampler.launch.server import TritonServer

COMMAND = [sys.executable, "-m", "simple_sampler.cli"]


def serve(*args, env=None):
    return subprocess.Popen([*COMMAND, "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


PORT_OPTIONS = ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")


def refused(*args, tmp_path, env=None) -> tuple[int, str]:
    """(status, stderr) of a `serve` that should refuse before it starts
    anything: each port it is not given a free one (never the defaults a
    `make serve` may hold), TMPDIR a test folder. One still running after
    60 s is stopped as Ctrl-C stops it (it stops what it started), and
    fails the test."""
    given = set(args)
    missing = [option for option in PORT_OPTIONS if option not in given]
    ports = free_ports(len(missing), {int(a) for a in args if a.isdigit()})
    process = serve(*args, *[str(x) for pair in zip(missing, ports) for x in pair],
                    env={**(env or os.environ), "TMPDIR": str(tmp_path)})
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
        pytest.fail("serve was still running after 60 s: it did not refuse")
    return process.returncode, stderr


@pytest.mark.slow
def test_serve_answers_and_stops_on_sigint(tmp_path):
    """...and keeps only Triton's log, in TMPDIR (its repository removed)."""
    ports = free_ports(3)
    process = serve("--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
                    "--metrics-port", str(ports[2]), "--instances", "1", "--sampler-only",
                    env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        line = process.stdout.readline()
        assert f"HTTP 127.0.0.1:{ports[0]}" in line, line + process.stderr.read()
        client = SamplerClient(f"127.0.0.1:{ports[1]}", "grpc")
        logits = np.zeros((2, 10), np.float32)
        logits[:, 4] = 9.0
        out = client.sample(logits, temperature=np.zeros((2, 1), np.float32))
        assert out["output_ids"][:, 0].tolist() == [4, 4]
        client.close()
    finally:
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "stopped" in stdout
    # The launcher's lifecycle, one log line per event (--log-level INFO, the default).
    events = [" ".join(line.split(": ", 1)[1].split()[:2])
              for line in stderr.splitlines() if " INFO simple_sampler." in line]
    assert events == ["model repository", "tritonserver started", "tritonserver ready",
                      "stopping tritonserver", "tritonserver stopped"], stderr
    [log_dir] = tmp_path.iterdir()
    assert [path.name for path in log_dir.iterdir()] == ["tritonserver.log"]


def test_free_ports_are_distinct_and_leave_the_taken_out(tmp_path):
    """Probes bound and closed one at a time could be given one port twice
    (Triton refused an HTTP port equal to its metrics port in a CI run)."""
    for _ in range(200):
        ports = free_ports(4, {free_port()})
        assert len(set(ports)) == 4
    taken = free_ports(50)
    assert not set(free_ports(20, set(taken))) & set(taken)
    server = TritonServer(tmp_path, grpc_port=taken[0])
    ports = (server.http_port, server.grpc_port, server.metrics_port)
    assert server.grpc_port == taken[0] and len(set(ports)) == 3


def test_port_taken_is_one_clear_error(tmp_path):
    """...and leaves nothing in the temporary folder (no repository, no
    empty log folder)."""
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        status, stderr = refused("--http-port", str(taken), tmp_path=tmp_path)
    assert status == 2
    assert f"port {taken} (http port) is already in use" in stderr
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_openai_port_taken_is_one_clear_error_before_triton_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        status, stderr = refused("--openai-port", str(taken), tmp_path=tmp_path)
    assert status == 2
    assert f"port {taken} (openai port) is already in use" in stderr
    assert "Traceback" not in stderr and "tritonserver started" not in stderr


def test_missing_server_binary_is_one_clear_error(tmp_path):
    env = {**os.environ, "TRITONSERVER": "/nonexistent/tritonserver"}
    _, stderr = refused(tmp_path=tmp_path, env=env)
    assert "TRITONSERVER=/nonexistent/tritonserver is not a file" in stderr
    assert "Traceback" not in stderr


def test_missing_stub_for_this_python_names_the_versions(monkeypatch):
    monkeypatch.setattr(install, "python_version", lambda: "3.99")
    monkeypatch.delenv("TRITONSERVER", raising=False)
    with pytest.raises(install.InstallError, match=r"no Python backend stub for Python 3.99 "
                                                   r"\(it has .*3\.11"):
        install.find_triton()


def test_bad_setting_is_one_clear_error(tmp_path):
    _, stderr = refused("--instances", "0", tmp_path=tmp_path)
    assert "sampler_instances must be >= 1, got 0" in stderr


def test_fill_template_in_place(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text("count: ${sampler_instances}\n")
    subprocess.run([*COMMAND, "fill-template", "-i", str(config), "sampler_instances:4"],
                   check=True)
    assert config.read_text() == "count: 4\n"
    result = subprocess.run([*COMMAND, "fill-template", "-i", str(config), "bogus:1"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no placeholder named bogus" in result.stderr


def test_the_log_level_reaches_the_model_processes_and_is_checked(monkeypatch, tmp_path):
    from simple_sampler.logs import LOG_LEVEL_ENV, configure
    from simple_sampler.launch.server import TritonServer

    server = TritonServer(tmp_path, log_level="WARNING")
    assert server.environment()[LOG_LEVEL_ENV] == "WARNING"
    with pytest.raises(ValueError, match="log level must be one of DEBUG, INFO, WARNING, ERROR"):
        configure("LOUD")


def test_http_clients_log_a_line_per_request_only_at_debug():
    """The front door's /metrics fetches Triton's over httpx, whose INFO line
    per request would fill serve's console at every Prometheus scrape."""
    import logging

    from simple_sampler.logs import configure

    root = logging.getLogger()
    kept = root.level, [logging.getLogger(name).level for name in ("httpx", "httpcore")]
    try:
        configure("INFO")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("simple_sampler.frontend").isEnabledFor(logging.INFO)
        configure("DEBUG")
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
        configure("ERROR")
        assert not logging.getLogger("httpx").isEnabledFor(logging.WARNING)
    finally:
        root.setLevel(kept[0])
        for name, level in zip(("httpx", "httpcore"), kept[1]):
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("args, message", [
    (["--openai-port", "65536"], "openai_port must be in [0, 65535], got 65536"),
    (["--http-port", "70000"], "http_port must be in [1, 65535], got 70000"),
    (["--grpc-port", "-1"], "grpc_port must be in [1, 65535], got -1"),
    (["--http-port", "18000", "--grpc-port", "18000"], "grpc_port and http_port are both 18000"),
    (["--openai-port", "8001"], "openai_port and grpc_port are both 8001"),
    (["--shutdown-grace", "nan"], "shutdown_grace_s must be a finite number >= 0.0, got nan"),
    (["--engine", "simulated", "--sim-step-b-ms", "inf"], "sim_step_b_ms must be a finite number"),
    (["--sim-vocab", "49152"], "sim_vocab applies to engine simulated only, not torch"),
    (["--engine", "static", "--sim-step-a-ms", "1"], "sim_step_a_ms applies to engine simulated only"),
    (["--hot-vocab", "/nonexistent/profile.npz"], "--hot-vocab '/nonexistent/profile.npz': no "
                                                   "such profile file"),
    (["--sampler-endpoints", "local,h:99999"], "sampler_endpoints must be 'local' or host:port"),
    (["--sampler-endpoints", "local,h:٨٠٠١"], "sampler_endpoints must be 'local' or host:port"),
    (["--sampler-endpoints", "local,::1"], "an IPv6 host in brackets"),
    (["--sampler-endpoints", "h:8001,H:08001"], "sampler_endpoints lists an entry twice"),
    (["--max-batch-size", "8"], "engine_max_batch_size (32) is more than the sampler's "
                                "sampler_max_batch_size (8, --max-batch-size)"),
    (["--vocab-size", "1000"], "the hot-vocab profile hot_vocab.npz is for a vocabulary of "
                               "49152 tokens, the sampler's vocab_size is 1000"),
    (["--model", "/models/llama", "--handoff", "hot-first"],
     "--handoff hot-first: the sampler has no hot-vocab profile"),
    (["--sampling-mode", "inline", "--micro-batches", "2"],
     "micro_batches applies to sampling_mode simple only"),
    (["--sampler-only", "--engine", "simulated", "--openai-port", "9100"],
     "--engine, --openai-port apply to the llm, which --sampler-only does not serve"),
    (["--model-repository", "/tmp/repo", "--instances", "4", "--engine", "tensorrt_llm",
      "--micro-batches", "2", "--hot-vocab", "off"],
     "--instances, --micro-batches, --hot-vocab would not reach the models: --model-repository "
     "serves /tmp/repo"),
    (["--sampler-only", "--openai-port", "0", "--sampling-mode", "inline"],
     "--sampling-mode applies to the llm, which --sampler-only does not serve"),
    (["--sampler-only", "--openai-port", "0", "--no-decoupled-mode"],  # named as given
     "--no-decoupled-mode applies to the llm, which --sampler-only does not serve"),
])
def test_options_out_of_range_or_at_odds_are_one_line_before_anything_starts(
        args, message, capsys, monkeypatch, tmp_path):
    """Each is refused with exit status 2 and one line naming the option
    and what it allows, before a repository is assembled or Triton starts."""
    from simple_sampler import cli

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where serve assembles its repository
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert cli.main(["serve", *args]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("simple-sampler serve: ") and message in stderr, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no repository left half-written


def test_a_log_file_that_cannot_be_written_is_one_line(capsys, monkeypatch, tmp_path):
    from simple_sampler import cli

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    http, grpc, metrics = free_ports(3)
    assert cli.main(["serve", "--sampler-only", "--http-port", str(http), "--grpc-port",
                     str(grpc), "--metrics-port", str(metrics),
                     "--log", "/nonexistent/logs/tritonserver.log"]) == 2
    stderr = capsys.readouterr().err
    assert "/nonexistent/logs/tritonserver.log" in stderr and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []  # neither its repository nor a copy of the backends


def test_hot_vocab_auto_on_a_sampler_host_matches_a_serving_host_with_defaults():
    """--hot-vocab auto: a --sampler-only server for SmolLM2's vocabulary
    holds the shipped profile, as the serving host started with defaults
    does (its remote requests carry that hot set's fingerprint, which the
    sampler host checks); for any other vocabulary (or any, 0) none."""
    from simple_sampler.cli import build_parser, hot_vocab_profile

    parser = build_parser()
    for extra, profile in ((["--vocab-size", "49152"], "hot_vocab.npz"),
                           (["--vocab-size", "151936"], ""), ([], ""),
                           (["--vocab-size", "49152", "--hot-vocab", "off"], "")):
        args = parser.parse_args(["serve", "--sampler-only", *extra])
        assert hot_vocab_profile(args) == profile, extra
    assert hot_vocab_profile(parser.parse_args(["serve"])) == "hot_vocab.npz"


def test_a_repository_is_sized_by_the_launch_options_as_given(monkeypatch):
    """With --model-repository the sampler's batch (by either flag) and
    --logits-dtype size Triton's shared memory as given: the repository's
    engine is in its files, not on the command line."""
    from simple_sampler import cli
    from simple_sampler.launch import serve as serving

    seen = []
    monkeypatch.setattr(serving, "run", lambda sampler, *args, **kwargs: seen.append(sampler) or 0)
    for flag in ("--max-batch-size", "--sampler-max-batch-size"):
        assert cli.main(["serve", "--model-repository", "/tmp/repo", flag, "128",
                         "--logits-dtype", "bf16"]) == 0
    assert [(s.sampler_max_batch_size, s.logits_dtype) for s in seen] == [(128, "bf16")] * 2


def test_generate_over_http_defaults_to_the_http_port_and_names_a_dead_one(capsys, monkeypatch):
    """generate --protocol http goes to the HTTP port by default (8000, not
    gRPC's 8001), and nobody there is one line, not a traceback; it has no
    logprob options, since it prints text alone."""
    import simple_sampler.client
    from simple_sampler import cli
    from simple_sampler.client import Chunk

    made = []

    class Recording:
        def __init__(self, url, protocol):
            made.append((url, protocol))

        def generate(self, prompt, **params):
            return Chunk("hello")

    with monkeypatch.context() as patched:
        patched.setattr(simple_sampler.client, "GenerateClient", Recording)
        assert cli.main(["generate", "hi", "--protocol", "http"]) == 0
        assert cli.main(["generate", "hi"]) == 0
    assert made == [("127.0.0.1:8000", "http"), ("127.0.0.1:8001", "grpc")]
    capsys.readouterr()
    (port,) = free_ports(1)
    assert cli.main(["generate", "hi", "--protocol", "http", "--url", f"127.0.0.1:{port}"]) == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"simple-sampler generate: cannot reach http://127.0.0.1:{port}/")
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    for _ in range(3):  # over gRPC the stream may fail before its request is queued
        assert cli.main(["generate", "hi", "--url", f"127.0.0.1:{port}"]) == 1
        stderr = capsys.readouterr().err
        assert stderr.startswith("simple-sampler generate: ") and "Traceback" not in stderr
        assert len(stderr.strip().splitlines()) == 1, stderr
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--num-top-logprobs", "2"])
