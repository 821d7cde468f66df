"""`simple-sampler perf`: the figures computed from a perf_analyzer profile
export, the command line it runs, and its errors (the end-to-end run is
`make perf`, which needs the perf_analyzer binary)."""
import json

import pytest

from simple_sampler.bench import perf

MS = 1_000_000  # perf_analyzer's timestamps are nanoseconds


def streamed_request(sent_ms: float, first_ms: float, gap_ms: float, tokens: int) -> dict:
    return {"timestamp": int(sent_ms * MS),
            "response_timestamps": [int((first_ms + i * gap_ms) * MS) for i in range(tokens)]}


def export(requests, boundaries_ms, concurrency=2) -> dict:
    return {"experiments": [{"experiment": {"mode": "concurrency", "value": concurrency},
                             "requests": requests,
                             "window_boundaries": [int(b * MS) for b in boundaries_ms]}],
            "version": "2.50.0"}


def test_figures_count_only_the_last_three_windows():
    requests = [
        streamed_request(0, 50, 10, 5),       # ends at 90 ms: inside window 0, not measured
        streamed_request(100, 150, 20, 5),    # responses 150..230 ms
        streamed_request(200, 260, 40, 5),    # responses 260..420 ms
        streamed_request(390, 420, 10, 10),   # responses 420..510 ms: last one after the end
    ]
    figures = perf.figures_from_export(export(requests, [0, 100, 200, 300, 500]))
    # windows 1-3 span 100..500 ms; 5 + 5 + 8 responses fall inside, two requests complete
    assert figures["tokens"] == 18 and figures["requests"] == 2
    assert figures["window_s"] == pytest.approx(0.4)
    assert figures["tokens_per_s"] == pytest.approx(18 / 0.4)
    assert figures["requests_per_s"] == pytest.approx(2 / 0.4)
    assert figures["p50_ttft_ms"] == pytest.approx((50 + 60) / 2)
    assert figures["p50_latency_ms"] == pytest.approx((130 + 220) / 2)
    assert figures["p50_itl_ms"] == pytest.approx(30)  # gaps: 4 x 20 ms, 4 x 40 ms
    assert figures["p95_itl_ms"] == pytest.approx(40)
    assert figures["concurrency"] == 2


def test_an_export_without_completed_requests_is_an_error():
    with pytest.raises(perf.PerfError, match="no request completed"):
        perf.figures_from_export(export([streamed_request(0, 50, 10, 2)], [0, 100, 200, 300, 400]))


def test_the_command_streams_over_grpc_with_the_shipped_inputs(tmp_path):
    command = perf.analyzer_command("pa", "127.0.0.1:9001", 8, perf.shipped_inputs(),
                                    tmp_path / "e.json", tmp_path / "s.csv", 20)
    assert command[:7] == ["pa", "-m", "ensemble", "-u", "127.0.0.1:9001", "-i", "grpc"]
    assert "--streaming" in command
    assert command[command.index("--concurrency-range") + 1] == "8:8"
    assert command[command.index("--measurement-request-count") + 1] == "16"
    data = json.loads(perf.shipped_inputs().read_text())["data"]
    assert len(data) >= 8 and len({d["random_seed"][0] for d in data}) == len(data)
    assert all(d["stream"] == [True] and d["max_tokens"] == d["min_length"] for d in data)


def test_analyzer_summary_reads_the_csv(tmp_path):
    csv = tmp_path / "summary.csv"
    csv.write_text("Concurrency,Inferences/Second,Client Send,p95 latency,Response Throughput\n"
                   "8,1.25,10,2500000,80.5\n")
    assert perf.analyzer_summary(csv) == {"requests_per_s": 1.25, "responses_per_s": 80.5,
                                          "p95_latency_ms": 2500.0}


def test_a_missing_binary_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PERF_ANALYZER", raising=False)
    monkeypatch.setattr(perf, "project_file", lambda relative: tmp_path / relative)
    with pytest.raises(perf.PerfError, match="make perf"):
        perf.find_perf_analyzer()
    binary = tmp_path / "perf_analyzer"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert perf.find_perf_analyzer() == str(binary)
    assert perf.find_perf_analyzer(str(binary)) == str(binary)


def test_a_failing_analyzer_reports_its_first_lines(tmp_path):
    fake = tmp_path / "perf_analyzer"
    fake.write_text("#!/bin/sh\necho 'Error: Failed to parse --profile-export-file.'\n"
                    "for i in $(seq 1 40); do echo \"usage line $i\"; done\nexit 99\n")
    fake.chmod(0o755)
    with pytest.raises(perf.PerfError) as failure:
        perf.run_analyzer([str(fake)], "simple c=1")
    message = str(failure.value)
    assert "exit 99" in message and "Failed to parse --profile-export-file" in message
    assert "usage line 40" in message and "usage line 20" not in message


def test_a_cut_off_export_is_measured_again(tmp_path):
    """perf_analyzer 2.50 was seen exiting 0 with its export cut off."""
    export, runs = tmp_path / "export.json", tmp_path / "runs"
    fake = tmp_path / "perf_analyzer"
    whole = json.dumps(export_data := {"experiments": []})
    fake.write_text(f"#!/bin/sh\necho run >> {runs}\n"
                    f"if [ $(wc -l < {runs}) -eq 1 ]; then printf '{whole[:10]}' > {export}; "
                    f"else printf '{whole}' > {export}; fi\n")
    fake.chmod(0o755)
    assert perf.measure([str(fake)], export, "simple c=8") == export_data
    assert runs.read_text().count("run") == 2
    runs.unlink()
    fake.write_text(f"#!/bin/sh\necho run >> {runs}\nprintf '{whole[:10]}' > {export}\n")
    with pytest.raises(perf.PerfError, match="incomplete profile export 2 times"):
        perf.measure([str(fake)], export, "simple c=8")
