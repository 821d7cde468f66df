"""`simple-sampler gpu-check`: the first run on a GPU host, checked end to end.

Run inside the NGC image (``scripts/gpu_first_run.sh`` calls it), it takes
TensorRT-LLM's own greedy reference *before* starting the server (in a child
process, so its GPU memory is gone by then), starts ``serve``'s repository on
free loopback ports, runs the checks in order (reference, server, greedy,
seeded, sampler, near context, bridge, tp2: skipped and said so with one GPU),
writes ``gpu-first-run.json`` and ``gpu-first-run.md`` in ``--out`` and exits 0
only when every check that ran passed. ``--dry-run`` runs the same checks on
``--engine simulated`` so CI tests the logic (tests/test_gpu_check.py).

What each check passes on, what a failure means, and the dry run's rules:
docs/GPU.md, "First GPU run, step by step" (4. Run the check).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import re
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..serving.engines import engine_spec
from ..settings import LlmSettings, SamplerSettings

PROMPT = "The capital of France is"
NEAR_CONTEXT_MARGIN = 8  # tokens the near-context request generates
FILLER = "The quick brown fox jumps over the lazy dog. "
SEED = 1234
RESULT_NAME = "gpu-first-run"
REFERENCE_TIMEOUT_S = 3600.0  # the engine build included, never timed here: generous
REFERENCE_MARK = "simple-sampler reference ids: "  # the child's answer among TensorRT-LLM's lines


@dataclass
class Check:
    name: str
    passed: bool | None  # None: skipped
    detail: str
    figures: dict = field(default_factory=dict)


@dataclass
class Options:
    model: str
    engine: str = "tensorrt_llm"
    out: Path = Path("gpu-first-run")
    max_context: int = 2048
    max_tokens: int = 32
    engine_max_batch_size: int = 32
    instances: int = 2
    prompt: str = PROMPT
    startup_timeout: float = 1800.0
    reference_timeout: float = REFERENCE_TIMEOUT_S

    @property
    def dry_run(self) -> bool:
        return self.engine == "simulated"

    def llm_settings(self, tensor_parallel_size: int = 1) -> LlmSettings:
        return LlmSettings(engine=self.engine, model=self.model,
                           engine_max_batch_size=self.engine_max_batch_size,
                           max_context=self.max_context,
                           tensor_parallel_size=tensor_parallel_size,
                           sampler_shards=self.instances).validate()

    def sampler_settings(self) -> SamplerSettings:
        # The dtype the engine's rows come in (EngineSpec.logits_dtype), else float32.
        dtype = engine_spec(self.engine).logits_dtype(self.llm_settings()) or "fp32"
        return SamplerSettings(sampler_instances=self.instances, logits_dtype=dtype)


def codec_for(options: Options):
    """The codec the server's preprocessing encodes with (the engine's)."""
    return engine_spec(options.engine).codec(options.llm_settings())


def simulated_reference(options: Options, prompt_ids: list[int]) -> list[int]:
    """The dry run's reference: a fresh simulated engine's own argmax."""
    settings = options.llm_settings()
    engine = engine_spec(settings.engine).build(settings)
    engine.add(0, prompt_ids)
    tokens = []
    for index in range(options.max_tokens):
        tokens.append(int(engine.step([0])[0].float().argmax()))
        if index + 1 < options.max_tokens:
            engine.append([0], [tokens[-1]])
    return tokens


REFERENCE_EXIT_GRACE_S = 60.0  # after its ids, how long the child may take to exit
REFERENCE_POLL_S = 0.5
REFERENCE_PROGRESS_S = 60.0  # how often a long reference run says it is still going
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL for a reference run that is stopped


def reference_command(request: dict) -> list[str]:
    """The reference child, started the way the server starts the ``llm``
    model's stub: not under ``mpirun`` (TensorRT-LLM's LLM API spawns its
    MPI workers from a process of its own either way, docs/GPU.md, "MPI"),
    with this interpreter, isolated from ``PYTHON*`` variables as the
    Python backend's stubs are (``-I``; docs/GPU.md, "Without Docker")."""
    return [sys.executable, "-I", "-m", __name__, "--reference", json.dumps(request)]


def reference_environment() -> dict[str, str]:
    """The server's model processes' ``PATH`` (``launch/server.py``
    ``TritonServer.environment``): this interpreter's directory first, so the
    MPI runtime and TensorRT-LLM find the same programs as in the server."""
    return {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                   os.environ.get("PATH", "")])}


def reference_ids(output: str) -> list[int] | None:
    """The ids the child printed after ``REFERENCE_MARK`` (its last such line)."""
    marked = [line[len(REFERENCE_MARK):] for line in output.splitlines()
              if line.startswith(REFERENCE_MARK)]
    return json.loads(marked[-1]) if marked else None


def stop_process_group(child: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the child's process group (it leads one:
    ``start_new_session``), so TensorRT-LLM's MPI workers that stay in it go
    too. A process that left the group (an MPI daemon that detached) is not
    reached: ``nvidia-smi`` lists it if it holds the GPU."""
    for signal_number, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, signal_number)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def run_reference_child(command: list[str], log_path: Path, timeout_s: float,
                        exit_grace_s: float = REFERENCE_EXIT_GRACE_S,
                        env: dict[str, str] | None = None) -> list[int]:
    """Runs the reference child, its output in ``log_path``, and returns its
    ids. The LLM API can hang at exit, after its answer (``LLM.shutdown``
    waiting on its MPI workers), so a child that printed its ids and has not
    exited ``exit_grace_s`` later is stopped and its ids kept (said on
    stdout); one that gives no ids within ``timeout_s`` is stopped and
    reported with its output's tail. Every ``REFERENCE_PROGRESS_S`` it says it
    is still waiting, and on what."""
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env)
    started = time.monotonic()
    answered_at = None
    next_progress = started + REFERENCE_PROGRESS_S
    while True:
        try:
            status = child.wait(timeout=REFERENCE_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        output = log_path.read_text(errors="replace")
        ids = reference_ids(output)
        if ids is not None and answered_at is None:
            answered_at = now
        if answered_at is not None and now - answered_at >= exit_grace_s:
            stop_process_group(child)
            print(f"gpu-check: TensorRT-LLM's reference run printed its ids but had not exited "
                  f"{exit_grace_s:.0f} s later (the LLM API can hang at exit): stopped it "
                  f"(process group {child.pid}), its ids kept", flush=True)
            return ids
        if answered_at is None and now - started >= timeout_s:
            stop_process_group(child)
            raise RuntimeError(f"TensorRT-LLM's greedy reference run gave no ids within "
                               f"{timeout_s:.0f} s (--reference-timeout): stopped it (process "
                               f"group {child.pid}); its output ({log_path}):\n{output[-4000:]}")
        if now >= next_progress:
            last = (output.strip().splitlines() or ["(no output yet)"])[-1][:200]
            print(f"gpu-check: the reference run is still going, {now - started:.0f} s of "
                  f"{timeout_s:.0f} s (--reference-timeout); its last line: {last}", flush=True)
            next_progress += REFERENCE_PROGRESS_S
    output = log_path.read_text(errors="replace")
    ids = reference_ids(output)
    if status != 0 or ids is None:
        raise RuntimeError(f"TensorRT-LLM's greedy reference run failed (status {status}; "
                           f"{log_path}):\n{output[-4000:]}")
    return ids


def tensorrt_llm_reference(options: Options, prompt_ids: list[int]) -> list[int]:
    """``serving.trtllm_api.greedy_reference`` in a child process (its GPU memory
    and MPI workers end with it; TensorRT-LLM wants its entry point under
    ``__main__``), its output in ``logs/reference.log``, within
    ``options.reference_timeout`` (``run_reference_child``)."""
    request = {"model": options.model, "prompt_ids": prompt_ids,
               "max_tokens": options.max_tokens, "max_batch_size": options.engine_max_batch_size,
               "max_context": options.max_context}
    log_path = options.out / "logs" / "reference.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: TensorRT-LLM's own greedy run (the first run builds the engine: "
          f"minutes; at most {options.reference_timeout:.0f} s, --reference-timeout); its "
          f"output: {log_path}", flush=True)
    return run_reference_child(reference_command(request), log_path, options.reference_timeout,
                               env=reference_environment())


SETTLE_POLL_S = 0.2
SETTLE_TIMEOUT_S = 5.0
WATCHED_METRICS = ("simple_llm_", "nv_inference_request_success")


def metrics(server) -> str:
    """The server's metrics once the counters this check reads have settled:
    the llm model reports its counters right after it sends a request's
    final response, so a scrape right after the answer may miss them."""
    def watched(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(WATCHED_METRICS)]

    current = urllib.request.urlopen(server.metrics_url).read().decode()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        previous, current = current, urllib.request.urlopen(server.metrics_url).read().decode()
        if watched(previous) == watched(current):
            break
    return current


def metric_sum(text: str, name: str, model: str | None = None) -> float | None:
    """The sum of a metric's series (of one model's, if given); None when absent."""
    labels = rf'\{{[^}}]*model="{model}"[^}}]*\}}' if model else r"(?:\{[^}]*\})?"
    values = re.findall(rf"^{name}{labels} (\S+)", text, re.M)
    return sum(float(v) for v in values) if values else None


def near_context_prompt(codec, max_context: int) -> tuple[str, int]:
    """A prompt of at most ``max_context - NEAR_CONTEXT_MARGIN`` tokens, as
    close to it as whole filler sentences allow."""
    limit = max_context - NEAR_CONTEXT_MARGIN
    per_sentence = max(1, len(codec.encode(FILLER * 8)) // 8)
    count = max(1, limit // per_sentence)
    while count > 1 and len(codec.encode(FILLER * count)) > limit:
        count -= 1
    text = FILLER * count
    return text, len(codec.encode(text))


def start_server(options: Options, tensor_parallel_size: int, log_path: Path):
    from .serve import assemble_in_temp, shared_memory_bytes
    from .server import TritonServer

    sampler, llm = options.sampler_settings(), options.llm_settings(tensor_parallel_size)
    repository = assemble_in_temp(sampler, llm, "simple-sampler-gpu-check-")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = TritonServer(repository, shm_bytes=shared_memory_bytes(sampler), log_path=log_path,
                          temporary_repository=True)
    return server.start(options.startup_timeout)


def greedy_check(client, options: Options, reference: list[int], name: str = "greedy") -> Check:
    answer = client.generate(options.prompt, max_tokens=options.max_tokens, temperature=0.0,
                             apply_chat_template=False, exclude_input_in_output=True)
    served = list(answer.token_ids)
    same = served == reference[:len(served)] and (
        len(served) == options.max_tokens or answer.finish_reason == "stop")
    first_difference = next((i for i, (a, b) in enumerate(zip(served, reference)) if a != b),
                            len(served))
    detail = ("served greedy ids equal the reference's" if same else
              f"served ids differ from the reference from position {first_difference}")
    return Check(name, same, detail, {"served": served, "reference": reference,
                                      "finish_reason": answer.finish_reason})


def seeded_check(client, options: Options) -> Check:
    # The dry run's rows repeat every BANK_OFFSETS + 1 steps (module docstring).
    from ..serving.simulated import BANK_OFFSETS

    tokens = BANK_OFFSETS + 1 if options.dry_run else options.max_tokens
    params = dict(max_tokens=tokens, min_length=tokens, temperature=1.0, top_p=0.9, seed=SEED,
                  apply_chat_template=False, exclude_input_in_output=True)
    first, second = (list(client.generate(options.prompt, **params).token_ids) for _ in range(2))
    return Check("seeded", first == second and len(first) == tokens,
                 "the same seeded request, sent twice alone, gave the same ids" if first == second
                 else "the same seeded request gave different ids", {"first": first,
                                                                     "second": second})


def near_context_check(client, codec, options: Options) -> Check:
    text, length = near_context_prompt(codec, options.max_context)
    max_tokens = options.max_context - length
    try:
        answer = client.generate(text, max_tokens=max_tokens, min_length=max_tokens,
                                 temperature=0.0, exclude_input_in_output=True)
    except Exception as error:  # noqa: BLE001 - the failure is the check's result
        return Check("near_context", False, f"a {length}-token prompt was refused: {error}",
                     {"prompt_tokens": length})
    passed = answer.num_input_tokens == length and len(answer.token_ids) == max_tokens
    return Check("near_context", passed,
                 f"a {length}-token prompt (context {options.max_context}) got "
                 f"{len(answer.token_ids)} of {max_tokens} tokens", {"prompt_tokens": length,
                                             "generated": len(answer.token_ids)})


def visible_gpus() -> list[str]:
    """``nvidia-smi -L``'s lines: asked outside this process, which must not
    hold a CUDA context (and its memory) while the server runs."""
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def environment(options: Options) -> dict:
    facts = {"python": sys.version.split()[0], "platform": platform.platform(),
             "gpus": visible_gpus(), "engine": options.engine, "model": options.model or
             "(simulated)", "max_context": options.max_context, "max_tokens": options.max_tokens}
    if not options.dry_run:  # its version without importing it here (module docstring)
        from importlib.metadata import PackageNotFoundError, version

        try:
            facts["tensorrt_llm"] = version("tensorrt_llm")
        except PackageNotFoundError:
            facts["tensorrt_llm"] = "not installed"
    return facts


def run_checks(options: Options) -> dict:
    """Every check in order (module docstring); the result as a dict."""
    from ..client import GenerateClient

    started = time.monotonic()
    checks: list[Check] = []
    result = {"dry_run": options.dry_run, "environment": environment(options), "checks": checks,
              "logs": str(options.out / "logs")}
    codec = codec_for(options)
    prompt_ids = codec.encode(options.prompt)
    reference = (simulated_reference if options.dry_run else tensorrt_llm_reference)(
        options, prompt_ids)
    checks.append(Check("reference", True, f"{len(reference)} greedy ids for a "
                        f"{len(prompt_ids)}-token prompt, before the server started",
                        {"prompt_ids": prompt_ids, "ids": reference}))
    server = start_server(options, 1, options.out / "logs" / "tritonserver.log")
    try:
        checks.append(Check("server", True, f"ready: HTTP {server.http_url}, gRPC "
                            f"{server.grpc_url}, metrics {server.metrics_url}"))
        client = GenerateClient(server.grpc_url, "grpc")
        before = metrics(server)
        greedy = greedy_check(client, options, reference)
        after_greedy = metrics(server)
        checks += [greedy, seeded_check(client, options)]
        checks.append(sampler_check(before, metrics(server)))
        checks.append(bridge_check(before, after_greedy, len(greedy.figures["served"]), options))
        checks.append(near_context_check(client, codec, options))
    finally:
        server.stop()
    checks.append(tp2_check(options, reference))
    result["seconds"] = round(time.monotonic() - started, 1)
    result["passed"] = all(c.passed is not False for c in checks)
    return result


def sampler_check(before: str, after: str) -> Check:
    answered = (metric_sum(after, "nv_inference_request_success", "simple_sampler") or 0) - \
        (metric_sum(before, "nv_inference_request_success", "simple_sampler") or 0)
    sampler_us = (metric_sum(after, "simple_llm_sampler_us_total") or 0) - \
        (metric_sum(before, "simple_llm_sampler_us_total") or 0)
    return Check("sampler", answered > 0 and sampler_us > 0,
                 f"simple_sampler answered {answered:.0f} requests, the decode loop counted "
                 f"{sampler_us / 1e3:.1f} ms of sampler time",
                 {"sampler_requests": answered, "sampler_us": sampler_us})


def bridge_check(before: str, after: str, iterations: int, options: Options) -> Check:
    total_before, total_after = (metric_sum(text, "simple_llm_bridge_us_total")
                                 for text in (before, after))
    if total_after is None:
        return Check("bridge", False, "simple_llm_bridge_us_total is not exported")
    per_iteration = (total_after - (total_before or 0)) / max(1, iterations)
    if options.dry_run:
        return Check("bridge", per_iteration == 0, "exported; 0 on the simulated engine (no "
                     "bridge)", {"us_per_iteration": per_iteration})
    return Check("bridge", per_iteration > 0, f"{per_iteration:.0f} us per iteration, one "
                 f"request (staging the rows, masking them)", {"us_per_iteration": per_iteration})


def tp2_check(options: Options, reference: list[int]) -> Check:
    gpus = len(visible_gpus())
    if options.dry_run or gpus < 2:
        return Check("tp2", None, f"skipped: {gpus} GPU(s) visible" +
                     (" (dry run)" if options.dry_run else ""))
    from ..client import GenerateClient

    server = start_server(options, 2, options.out / "logs" / "tritonserver-tp2.log")
    try:
        return greedy_check(GenerateClient(server.grpc_url, "grpc"), options, reference, "tp2")
    finally:
        server.stop()


def markdown(result: dict) -> str:
    env = result["environment"]
    title = "First GPU run" + (" (DRY RUN: simulated engine, no GPU)" if result["dry_run"] else "")
    lines = [f"# {title}",
             "", f"Result: **{'passed' if result['passed'] else 'FAILED'}** in "
             f"{result.get('seconds', 0)} s; logs in `{result['logs']}`.", "",
             "| fact | value |", "|---|---|"]
    lines += [f"| {k} | {', '.join(v) if isinstance(v, list) else v} |" for k, v in env.items()]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for check in result["checks"]:
        outcome = {True: "pass", False: "**FAIL**", None: "skipped"}[check["passed"]]
        lines.append(f"| {check['name']} | {outcome} | {check['detail']} |")
    return "\n".join(lines) + "\n"


def write_result(result: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    serializable = {**result, "checks": [asdict(c) for c in result["checks"]]}
    json_path, md_path = out / f"{RESULT_NAME}.json", out / f"{RESULT_NAME}.md"
    json_path.write_text(json.dumps(serializable, indent=2) + "\n")
    md_path.write_text(markdown(serializable))
    return json_path, md_path


def main(args: argparse.Namespace) -> int:
    """``simple-sampler gpu-check``."""
    options = Options(model=args.model or "", engine="simulated" if args.dry_run else
                      "tensorrt_llm", out=Path(args.out), max_context=args.max_context,
                      max_tokens=args.max_tokens, instances=args.instances,
                      startup_timeout=args.startup_timeout,
                      reference_timeout=args.reference_timeout)
    if not options.dry_run and not options.model:
        print("simple-sampler gpu-check: --model (a Hugging Face checkpoint directory, "
              "TinyLlama-1.1B-Chat) is required unless --dry-run", file=sys.stderr)
        return 2
    try:
        result = run_checks(options)
    except Exception as error:  # noqa: BLE001 - written down, then reported
        traceback.print_exc()
        result = {"dry_run": options.dry_run, "environment": {"engine": options.engine},
                  "checks": [Check("run", False, f"{type(error).__name__}: {error}")],
                  "logs": str(options.out / "logs"), "passed": False}
    json_path, md_path = write_result(result, options.out)
    print(md_path.read_text())
    print(f"written: {json_path}, {md_path}")
    return 0 if result["passed"] else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face checkpoint directory "
                        "(TinyLlama-1.1B-Chat-v1.0: docs/GPU.md)")
    parser.add_argument("--out", default="gpu-first-run", help="where the result and the "
                        "server logs go (default: ./gpu-first-run)")
    parser.add_argument("--max-context", type=int, default=2048,
                        help="max_seq_len of the engine (TinyLlama: 2048)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--instances", type=int, default=2, help="simple_sampler instances")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds the server may take to load (the engine build included)")
    parser.add_argument("--reference-timeout", type=float, default=REFERENCE_TIMEOUT_S,
                        help="seconds TensorRT-LLM's reference run may take to give its ids "
                        "(the engine build included); it is stopped after that")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same checks on the simulated engine: no GPU, no TensorRT-LLM")


def _reference_main(request: str) -> None:
    """The child process of :func:`tensorrt_llm_reference`: prints the ids."""
    from ..serving.trtllm_api import greedy_reference

    print(REFERENCE_MARK + json.dumps(greedy_reference(**json.loads(request))), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reference":
        _reference_main(sys.argv[2])
    else:
        sys.exit("usage: python -m simple_sampler.launch.gpu_check --reference JSON")
