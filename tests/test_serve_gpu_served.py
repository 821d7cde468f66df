"""`serve --engine static` (the registry, the CLI, the settings) and `bench
serve-gpu-served` end to end on the CPU (real servers, a tiny random-weight
shape: figures that mean nothing; the CUDA path has not run here)."""
import json
import shutil

import pytest

from simple_sampler.cli import build_parser
from simple_sampler.serving.engines import ENGINES, engine_spec
from simple_sampler.serving.static_decode import config_path
from simple_sampler.settings import ENGINE_NAMES, LlmSettings


def tiny_config(folder, **changes):
    """SmolLM2-135M's config cut to one narrow layer (its vocabulary kept:
    the prompts are tokenized with SmolLM2's tokenizer)."""
    config = json.loads(config_path("smollm2-135m").read_text())
    config.update(num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, **changes)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_serve_offers_the_static_engine_with_a_model_config():
    assert "static" in ENGINES and "static" in ENGINE_NAMES
    # argparse refuses an --engine outside its choices (SystemExit)
    args = build_parser().parse_args(["serve", "--engine", "static", "--device", "cpu",
                                      "--model-config", "smollm2-135m"])
    settings = LlmSettings.from_arguments(args).validate()
    assert (settings.engine, settings.model_config) == ("static", "smollm2-135m")
    assert LlmSettings.from_parameters(settings.parameters()) == settings  # through config.pbtxt
    with pytest.raises(ValueError, match="model_config applies to engine static only"):
        LlmSettings(engine="torch", model_config="smollm2-135m").validate()


def test_the_static_spec_builds_random_weights_and_labels_them(tmp_path):
    settings = LlmSettings(engine="static", model_config=str(tiny_config(tmp_path)),
                           engine_max_batch_size=2, max_context=16).validate()
    spec = engine_spec("static")
    engine = spec.build(settings)
    assert type(engine).__name__ == "StaticEngine" and engine.vocab_size == 49_152
    assert spec.vocab_size(settings, None) == 49_152
    assert "RANDOM WEIGHTS" in spec.describe(settings)
    engine.add("a", [1, 2, 3])
    assert tuple(engine.step(["a"]).shape) == (1, 49_152)


def test_the_hot_set_is_mapped_to_a_wider_shapes_ids():
    from simple_sampler.launch.install import project_file
    from simple_sampler.shvs.hot_vocab import load_profile

    profile = load_profile(project_file("model_repository/simple_sampler/hot_vocab.npz"))
    spec = engine_spec("static")
    wide = spec.hot_profile(profile, LlmSettings(engine="static", model_config="qwen2.5-0.5b"))
    assert wide.vocab_size == 151_936 and int(wide.order.max()) < 151_936
    same = spec.hot_profile(profile, LlmSettings(engine="static", model_config="smollm2-135m"))
    assert same is profile


@pytest.mark.slow  # two real servers on a tiny random-weight shape: 45-60 s on 2 cores
def test_the_served_bench_runs_through_real_servers_on_the_cpu(tmp_path):
    """simple_overlap (full rows over the arena, two lanes, each its own
    window of the static engine's slots) and inline, the comparison's two
    ends; simple is the same on one lane, simple_hot_first with --handoff
    hot-first (more starts would double the test's time: `bench
    serve-gpu-served --device cpu --quick` runs the default three)."""
    from simple_sampler.bench.serve_gpu_served import measuring as served

    modes = [m for m in served.MODES if m.name in ("simple_overlap", "inline")]
    report = served.run("cpu", str(tiny_config(tmp_path)), batches=[2], top_ps=[0.95],
                        modes=modes, max_tokens=32, instances=1, log_dir=tmp_path / "logs",
                        stacks=True, send_threads=2)
    assert report["kind"] == "serve-gpu-served" and report["rows"] == "flat (random weights)"
    assert [(r["mode"], r["micro_batches"]) for r in report["results"]] == [
        ("inline", 1), ("simple_overlap", 2)]
    for row in report["results"]:
        assert row["rows"] == "flat (random weights)" and row["batch"] == 2
        for key in ("tokens_per_s", "itl_ms_p50", "itl_ms_p95", "server_cores_busy",
                    "forward_only_tokens_per_s", "efficiency", "vs_inline",
                    "client_cores_busy"):
            assert row[key] > 0, key
        assert row["cpu_us_per_token"]["server"] > 0
        assert row["llm_ms_per_step"]["forward"] > 0
        assert row["llm_ms_per_step"]["gc"] >= 0  # the llm model's counter, read (not None)
    inline, overlap = report["results"]
    assert inline["sampler_requests_per_step"] is None  # inline sends the instances nothing
    # two lanes of one row each, one instance: a request per lane step (the rows' shards)
    assert 0.5 < overlap["sampler_requests_per_step"] <= 1.0
    assert overlap["sampler_us_per_request"]["execute"] > 0
    (bound,) = report["forward_only"]
    assert bound["tokens_per_s"] > 0 and bound["hbm_estimate_ms"] > 0
    for server in report["servers"]:  # stopped cleanly, its log kept
        assert server["exit_status"] == 0 and server["left_in_dev_shm"] == []
        assert (tmp_path / "logs" / f"{server['mode']}.log").stat().st_size > 0
    partial = json.loads((tmp_path / "logs" / served.PARTIAL).read_text())
    assert [r["mode"] for r in partial["results"]] == ["inline", "simple_overlap"]
    markdown = served.format_report(report)
    assert "RANDOM WEIGHTS" in markdown and "flat (random weights)" in markdown
    assert "simple_overlap: simple on two lanes" in markdown
    assert "| gc ms/step | sampler rq/step | us/rq |" in markdown
    # --stacks: each server's llm stub sampled its threads, its decode loop among them
    assert "- stacks: the llm stub's threads sampled every 5 ms" in markdown
    assert "; send_threads 2)" in markdown
    for mode in ("inline", "simple_overlap"):
        (stacks,) = (tmp_path / "logs" / "stacks" / mode).glob("llm-*.stacks")
        threads = {line.split(";")[0] for line in stacks.read_text().splitlines()}
        # the decode loop, and the one other send thread send_threads 2 gives its server
        assert {"decode-loop", "llm-send-1"} <= threads and "llm-send-2" not in threads


def test_a_mode_whose_server_fails_is_reported_and_the_next_modes_still_run(tmp_path,
                                                                            monkeypatch):
    """One server that does not start (here a stand-in for tritonserver
    refusing) costs its own mode only: the error is in the report and its
    Markdown, the server is still stopped, the other modes' rows are
    there, and inline (the baseline of every x inline) runs first."""
    from simple_sampler.bench.serve_gpu_served import measuring as served
    from simple_sampler.launch import server as launch_server

    assert served.MODES[0].name == "inline"
    started, stopped = [], []

    class Server:
        def __init__(self, repository, shm_bytes, log_path, temporary_repository):
            assert temporary_repository  # the bench's repository goes with its server
            self.log_path, self.repository = log_path, repository

        def start(self, timeout):
            started.append(self.log_path.stem)
            if self.log_path.stem == "simple":
                raise RuntimeError("tritonserver exited with status 1 during startup")
            self.process = type("Process", (), {"pid": 0})()

        def stop(self):
            stopped.append(self.log_path.stem)
            shutil.rmtree(self.repository)
            return 0

    monkeypatch.setattr(launch_server, "TritonServer", Server)
    monkeypatch.setattr("simple_sampler.launch.processes.list_stubs", lambda pid: [])
    monkeypatch.setattr(served, "server_processes", lambda pid: {"tritonserver": pid})
    monkeypatch.setattr(served, "forward_only_bounds", lambda *args: (
        {2: {"batch": 2, "tokens_per_s": 100.0, "ms_per_step": 20.0, "hbm_estimate_ms": 1.0}},
        {"name": "CPU", "torch": "-", "cuda": None, "dtype": "float32",
         "copy_bandwidth_gb_s": 1.0, "model": "tiny", "vocab": 64}))
    cell = {"tokens_per_s": 50.0, "itl_ms_p50": 1.0, "itl_ms_p95": 2.0,
            "server_cores_busy": 0.5, "client_cores_busy": 0.1,
            "cpu_us_per_token": {k: 1.0 for k in ("server", "tritonserver", "llm",
                                                  "preprocessing", "samplers", "client")},
            "llm_ms_per_step": {"forward": 1.0, "sampler": 1.0, "gc": 0.0}}
    monkeypatch.setattr(served, "measure_cell", lambda server, processes, mode, b, p, *rest: {
        **cell, "mode": mode.name, "batch": b, "top_p": p})
    modes = [m for m in served.MODES if m.name in ("inline", "simple", "simple_hot_first")]
    report = served.run("cpu", "smollm2-135m", batches=[2], top_ps=[1.0], modes=modes, max_tokens=32,
                        log_dir=tmp_path)
    assert started == stopped == ["inline", "simple", "simple_hot_first"]
    assert [r["mode"] for r in report["results"]] == ["inline", "simple_hot_first"]
    errors = {s["mode"]: s["error"] for s in report["servers"]}
    assert errors == {"inline": None, "simple_hot_first": None,
                      "simple": "RuntimeError: tritonserver exited with status 1 during startup"}
    assert "| simple | 0 | none | **RuntimeError: tritonserver exited" in served.format_report(report)


def test_the_served_bench_refuses_cuda_where_there_is_none(capsys):
    import torch

    from simple_sampler.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["bench", "serve-gpu-served", "--quick"]) == 2  # --device cuda by default
    assert "simple-sampler bench serve-gpu-served: device cuda:" in capsys.readouterr().err


def test_the_run_script_says_what_it_needs(tmp_path):
    """Its usage, and the tokenizer it needs, checked before any server starts
    (its dry run on the CPU: BENCH_ARGS="--device cpu --quick", by hand)."""
    import os
    import subprocess

    from simple_sampler.launch.install import project_file

    script = str(project_file("scripts/gpu_served_run.sh"))
    usage = subprocess.run(["bash", script], capture_output=True, text=True)
    assert usage.returncode == 2 and "OUT [--bundle DIR]" in usage.stderr
    missing = subprocess.run(["bash", script, str(tmp_path / "out")], capture_output=True,
                             text=True, env={**os.environ, "SIMPLE_SAMPLER_CACHE": str(tmp_path)})
    assert missing.returncode == 1 and "no SmolLM2 tokenizer" in missing.stderr
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "- commit: " in readme and "no SmolLM2 tokenizer" in readme


def test_the_compiled_decode_step_reaches_the_servers_settings():
    """--decode-step compiled: every server's llm model runs serve
    --compile-decode (its forward_only bound the compiled step too)."""
    from simple_sampler.bench.serve_gpu_served.measuring import MODES, static_settings

    args = build_parser().parse_args(["bench", "serve-gpu-served", "--decode-step", "compiled"])
    assert args.decode_step == "compiled"
    common = dict(device="cpu", dtype="float32", model_config="smollm2-135m", model=None,
                  largest=8, instances=1, micro_batches=1, stream_interval=1, max_context=64,
                  hot_vocab_profile="")
    for step, compiled in (("eager", False), ("compiled", True)):
        settings = static_settings(MODES[0], decode_step=step, **common).validate()
        assert settings.compile_decode is compiled
        parameters = LlmSettings.from_parameters(settings.parameters())  # config.pbtxt
        assert parameters.compile_decode is compiled
