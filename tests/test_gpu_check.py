"""`simple-sampler gpu-check` (launch/gpu_check.py): its dry run against a
real Triton server on the simulated engine (the logic the GPU run uses, so
it cannot rot), each check's verdict on bad answers, the result files, and
the TensorRT-LLM reference run against the fake of its API."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import fake_tensorrt_llm as fake
from fakes import wait_until
from simple_sampler.launch import gpu_check
from simple_sampler.launch.gpu_check import Options
from simple_sampler.pids import alive
from simple_sampler.serving.trtllm_api import greedy_reference

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["reference", "server", "greedy", "seeded", "sampler", "bridge", "near_context", "tp2"]


@pytest.mark.slow
def test_the_dry_run_passes_every_check_against_a_real_server(tmp_path):
    """scripts/gpu_first_run.sh --dry-run, as docs/GPU.md runs it (about a minute)."""
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_first_run.sh"), "--dry-run",
                          "--out", str(tmp_path), "--max-context", "512",
                          "--startup-timeout", "300"],
                         capture_output=True, text=True, timeout=580,
                         env={**os.environ,
                              "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "gpu-first-run.json").read_text())
    checks = {c["name"]: c for c in result["checks"]}
    assert list(checks) == CHECKS and result["dry_run"] and result["passed"]
    assert all(c["passed"] for name, c in checks.items() if name != "tp2")
    assert checks["tp2"]["passed"] is None and "skipped" in checks["tp2"]["detail"]
    greedy = checks["greedy"]["figures"]
    assert greedy["served"] == greedy["reference"] == checks["reference"]["figures"]["ids"]
    assert len(greedy["served"]) == 32
    assert checks["sampler"]["figures"]["sampler_requests"] > 0
    margin = gpu_check.NEAR_CONTEXT_MARGIN
    assert checks["near_context"]["figures"]["prompt_tokens"] > 512 - 2 * margin
    assert (tmp_path / "logs" / "tritonserver.log").stat().st_size > 0
    assert "DRY RUN" in (tmp_path / "gpu-first-run.md").read_text()


class ScriptedClient:
    """Answers generate() from a list, in order."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def generate(self, prompt, **params):
        return self.answers.pop(0)


def answer(ids, finish_reason="length", num_input_tokens=5):
    return SimpleNamespace(token_ids=ids, finish_reason=finish_reason,
                           num_input_tokens=num_input_tokens)


def test_the_greedy_check_fails_on_a_different_token_and_accepts_an_early_end():
    options = Options(model="m", max_tokens=4)
    reference = [5, 6, 7, 8]
    assert gpu_check.greedy_check(ScriptedClient(answer([5, 6, 7, 8])), options, reference).passed
    failed = gpu_check.greedy_check(ScriptedClient(answer([5, 9, 7, 8])), options, reference)
    assert failed.passed is False and "from position 1" in failed.detail
    # Stopped at the end id: a prefix of the reference (which ignores the end id).
    assert gpu_check.greedy_check(ScriptedClient(answer([5, 6], "stop")), options,
                                  reference).passed
    assert not gpu_check.greedy_check(ScriptedClient(answer([5, 6], "length")), options,
                                      reference).passed


def test_the_seeded_and_near_context_checks_fail_when_the_server_misbehaves():
    options = Options(model="m", max_tokens=3)
    assert not gpu_check.seeded_check(ScriptedClient(answer([1, 2, 3]), answer([1, 2, 4])),
                                      options).passed
    assert gpu_check.seeded_check(ScriptedClient(answer([1, 2, 3]), answer([1, 2, 3])),
                                  options).passed

    class Codec:
        def encode(self, text):
            return [0] * text.count(".")

    options = Options(model="m", max_context=100)
    text, length = gpu_check.near_context_prompt(Codec(), 100)
    assert length == 100 - gpu_check.NEAR_CONTEXT_MARGIN
    short = answer([1] * 3, num_input_tokens=length)
    assert not gpu_check.near_context_check(ScriptedClient(short), Codec(), options).passed

    class Refusing:
        def generate(self, prompt, **params):
            raise RuntimeError("Prompt length (92) exceeds maximum input length (64)")

    refused = gpu_check.near_context_check(Refusing(), Codec(), options)
    assert not refused.passed and "exceeds maximum input length" in refused.detail


METRICS = """# HELP x
nv_inference_request_success{{model="simple_sampler",version="1"}} {sampler}
nv_inference_request_success{{model="llm",version="1"}} 3
simple_llm_sampler_us_total{{model="llm",version="1"}} {sampler_us}
simple_llm_bridge_us_total{{model="llm",version="1"}} {bridge}
"""


def test_the_sampler_and_bridge_checks_read_the_metrics():
    before = METRICS.format(sampler=2, sampler_us=100, bridge=0)
    after = METRICS.format(sampler=12, sampler_us=900, bridge=3000)
    assert gpu_check.metric_sum(after, "nv_inference_request_success") == 15
    assert gpu_check.metric_sum(after, "nv_inference_request_success", "simple_sampler") == 12
    assert gpu_check.metric_sum(after, "absent") is None
    assert gpu_check.sampler_check(before, after).passed
    assert not gpu_check.sampler_check(before, before).passed  # the sampler did not decide
    engine = Options(model="m")
    bridge = gpu_check.bridge_check(before, after, 30, engine)
    assert bridge.passed and bridge.figures["us_per_iteration"] == 100
    assert not gpu_check.bridge_check(before, before, 30, engine).passed
    missing = "simple_llm_sampler_us_total 1\n"
    assert not gpu_check.bridge_check(missing, missing, 30, engine).passed


def test_a_failed_run_is_written_and_exits_1(tmp_path, monkeypatch):
    def broken(options):
        raise RuntimeError("tritonserver exited with status 1")

    monkeypatch.setattr(gpu_check, "run_checks", broken)
    args = SimpleNamespace(model="/m", dry_run=False, out=str(tmp_path), max_context=2048,
                           max_tokens=32, instances=2, startup_timeout=10.0,
                           reference_timeout=10.0)
    assert gpu_check.main(args) == 1
    result = json.loads((tmp_path / "gpu-first-run.json").read_text())
    assert not result["passed"] and "status 1" in result["checks"][0]["detail"]
    assert "**FAIL**" in (tmp_path / "gpu-first-run.md").read_text()
    assert gpu_check.main(SimpleNamespace(**{**vars(args), "model": None})) == 2


def test_the_tensorrt_llm_reference_is_the_engine_s_own_greedy_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 30}))
    seen = {}

    class Recording(fake.LLM):
        def __init__(self, model, **kwargs):
            seen.update(kwargs)
            super().__init__(model, **kwargs)

    ids = greedy_reference(tmp_path, [1, 2, 3], max_tokens=5, max_batch_size=4, max_context=64,
                           api=(Recording, *fake.API[1:]), build_cache_dir=tmp_path / "cache")
    # The fake's own greedy pick (no processor of ours: the padding wins).
    expected, tokens = [], [1, 2, 3]
    for _ in range(5):
        expected.append(int(fake.model_row(tokens, 30).argmax()))
        tokens.append(expected[-1])
    assert ids == expected
    # The served engine's limits: the same max_seq_len, and the build cache.
    assert seen["max_seq_len"] == 64 and seen["max_input_len"] == 63
    assert seen["enable_build_cache"].cache_root == tmp_path / "cache"
    assert "batched_logits_processor" not in seen


def child(script: str) -> list[str]:
    return [sys.executable, "-c", script]


def test_the_reference_child_s_answer_is_found_among_tensorrt_llm_s_lines(tmp_path):
    """run_reference_child reads the marked line from the child's log (TensorRT-LLM
    prints its own lines around it) and reports a failed child with the log's tail."""
    log = tmp_path / "reference.log"
    answering = child(f"print('[TensorRT-LLM] banner'); print({gpu_check.REFERENCE_MARK!r} + "
                      f"'[5, 6]'); print('[TensorRT-LLM][INFO] shutdown')")
    assert gpu_check.run_reference_child(answering, log, timeout_s=30) == [5, 6]
    failing = child("import sys; print('[TensorRT-LLM][ERROR] out of memory'); sys.exit(1)")
    with pytest.raises(RuntimeError, match="(?s)status 1.*out of memory"):
        gpu_check.run_reference_child(failing, log, timeout_s=30)


def test_a_reference_run_that_hangs_at_exit_is_stopped_and_its_ids_kept(tmp_path, capsys):
    """The LLM API can hang at exit after its answer: the check goes on with
    the ids, says so, and the child (with the process it started) is gone."""
    pid_file = tmp_path / "grandchild.pid"
    hanging = child("import subprocess, sys, time; "
                    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                    f"open({str(pid_file)!r}, 'w').write(str(g.pid)); "
                    f"print({gpu_check.REFERENCE_MARK!r} + '[7, 8]', flush=True); "
                    "time.sleep(60)")
    started = time.monotonic()
    ids = gpu_check.run_reference_child(hanging, tmp_path / "reference.log", timeout_s=30,
                                        exit_grace_s=1.0)
    assert ids == [7, 8] and time.monotonic() - started < 20
    assert "had not exited 1 s later" in capsys.readouterr().out
    grandchild = int(pid_file.read_text())
    # signalled with its group; its exit is not awaited
    assert wait_until(lambda: not alive(grandchild), timeout_s=10)  # the whole process group went


def test_a_reference_run_without_ids_times_out_with_a_clear_message(tmp_path):
    silent = child("import time; print('[TensorRT-LLM] building the engine', flush=True); "
                   "time.sleep(60)")
    started = time.monotonic()
    # 4 s: time enough for a loaded machine to start the child and print its line
    with pytest.raises(RuntimeError, match="(?s)no ids within 4 s \\(--reference-timeout\\)"
                       ".*building the engine"):
        gpu_check.run_reference_child(silent, tmp_path / "reference.log", timeout_s=4.0)
    assert time.monotonic() - started < 20


def test_the_reference_runs_as_the_server_s_stubs_do_and_takes_its_timeout(tmp_path, monkeypatch):
    """Not under mpirun, this interpreter first on PATH, isolated (-I) as the
    Python backend's stubs are; --reference-timeout reaches the run."""
    seen = {}

    def fake_run(command, log_path, timeout_s, env=None):
        seen.update(command=command, timeout_s=timeout_s, env=env)
        return [1]

    monkeypatch.setattr(gpu_check, "run_reference_child", fake_run)
    options = Options(model="/m", out=tmp_path, reference_timeout=42.0)
    assert gpu_check.tensorrt_llm_reference(options, [1, 2]) == [1]
    assert seen["command"][:4] == [sys.executable, "-I", "-m", gpu_check.__name__]
    assert "mpirun" not in " ".join(seen["command"]) and seen["timeout_s"] == 42.0
    assert seen["env"]["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


