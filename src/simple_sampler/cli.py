"""The `simple-sampler` command."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .launch import gpu_check
from .schema import ENSEMBLE
from .serving.engines import engine_spec
from .settings import (HANDOFFS, ROW_TRANSPORTS, SAMPLING_MODES, FrontendSettings, LlmSettings,
                       SamplerSettings)


def print_report(args: argparse.Namespace, report: dict, table: str) -> None:
    """One JSON object (report plus the machine) with --json, else the table."""
    from .bench import machine

    info = machine.describe()
    if args.json:
        print(json.dumps({**report, "machine": info}))
    else:
        print(table)
        print(f"\n{info['cpu']}, {info['cores']} cores, {info['date']}: {info['command']}")


def bench_kernels(args: argparse.Namespace) -> int:
    from .bench import kernels

    repeats, baseline_repeats = (5, 1) if args.quick else (args.repeats, 3)
    peer = None if args.no_peer else (args.peer_python or kernels.default_peer_python())
    results = kernels.run(vocabs=args.vocab, batch=args.batch, dtypes=args.dtype,
                          repeats=repeats, baseline_repeats=baseline_repeats,
                          threads=args.threads, peer_python=peer, clock=args.clock,
                          temperatures=args.temperature or [None], rows=args.rows or [None])
    print_report(args, {"results": results, "worst_over_floor": kernels.worst_over_floor(results)},
                 kernels.format_table(results))
    return 0


def bench_shvs(args: argparse.Namespace) -> int:
    from .bench import shvs

    report = shvs.run(profile_path=args.profile, repeats=3 if args.quick else args.repeats,
                      quick=args.quick)
    print_report(args, report, shvs.format_table(report))
    return 0


def bench_handoff(args: argparse.Namespace) -> int:
    from .bench import handoff
    from .handoff import DEFAULT_COLD_TOP

    report = handoff.run(profile_path=args.profile, repeats=3 if args.quick else args.repeats,
                         hot_size=args.hot_size,
                         cold_top=DEFAULT_COLD_TOP if args.cold_top is None else args.cold_top,
                         clock=args.clock)
    print_report(args, report, handoff.format_table(report))
    return 0


def bench_summary_gpu(args: argparse.Namespace) -> int:
    from .bench import summary_gpu

    sizes = {"shapes": ((49_152, "float32"),), "batches": (8,), "configs": ("plain", "top_p"),
             "repeats": 3} if args.quick else {"batches": args.batch, "repeats": args.repeats}
    try:
        report = summary_gpu.run(args.device, profile_path=args.profile, **sizes)
    except (RuntimeError, ValueError) as error:  # no CUDA here, or a dtype it lacks
        print(f"simple-sampler bench summary-gpu: {error}", file=sys.stderr)
        return 2
    print_report(args, report, summary_gpu.format_report(report))
    return 0


def bench_loop(args: argparse.Namespace) -> int:
    from .bench import loop

    report = loop.run(batch=args.batch, history=args.history, steps=args.steps,
                      rounds=args.rounds)
    print_report(args, report, loop.format_table(report))
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from .bench import calibrate

    calibrate.main(output=args.output, plot_path=args.plot, prompts=args.prompts,
                   tokens=args.tokens, sizes=args.sizes, repeats=args.repeats)
    return 0


def bench_sampler_server(args: argparse.Namespace) -> int:
    from .bench import sampler_server

    if args.endpoints:
        report = sampler_server.run_endpoints(max_endpoints=args.endpoints, batch_size=args.batch,
                                              vocab=args.vocab, seconds=args.seconds)
        print_report(args, report, sampler_server.format_endpoints_report(report))
        return 0
    report = sampler_server.run(max_instances=args.instances, batch_size=args.batch,
                                vocab=args.vocab, seconds=args.seconds)
    print_report(args, report, sampler_server.format_report(report))
    return 0


def bench_serve(args: argparse.Namespace) -> int:
    from .bench import serve as serve_bench

    report = serve_bench.run(concurrencies=args.concurrency, modes=args.modes,
                             max_tokens=args.max_tokens, instances=args.instances,
                             batch_invariant=[v == "on"
                                              for v in args.batch_invariant])
    print_report(args, report, serve_bench.format_report(report))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _vocab_shape(text: str) -> tuple[int, str]:
    """V:DTYPE (a simulated engine's vocabulary and logits dtype)."""
    from .settings import SIMULATED_DTYPES

    vocab, _, dtype = text.partition(":")
    if not vocab.isdigit() or int(vocab) < 1 or dtype not in SIMULATED_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected V:DTYPE with V >= 1 and DTYPE one of {', '.join(SIMULATED_DTYPES)}")
    return int(vocab), dtype


def bench_row_transport(args: argparse.Namespace) -> int:
    from .bench import row_transport

    # quick: 8 x 64 tokens, so a stub's CPU over the level spans several of
    # /proc's 10 ms ticks (8 x 8 tokens showed 0 for the hot-first samplers)
    sizes = ({"shapes": [(128_256, "float32")], "batches": [8], "max_tokens": 64} if args.quick
             else {"batches": args.batch, "shapes": args.shape or row_transport.SHAPES,
                   "max_tokens": args.max_tokens})
    report = row_transport.run(transports=args.transport, profile_dir=args.profile, **sizes)
    print_report(args, report, row_transport.format_report(report))
    return 0


def bench_serve_sim(args: argparse.Namespace) -> int:
    from .bench import serve_sim
    from .params import SamplingParams

    if not args.quick:
        sizes = {"batches": args.batch}
    elif args.server:
        sizes = {"batches": [8, 16], "max_tokens": 16}
    else:
        sizes = {"batches": [8, 16], "warmup": 2, "measure": 6}
    if args.server and (args.shvs or args.profile or args.top_p != 1.0):
        print("simple-sampler bench serve-sim: --shvs, --profile and --top-p are in-process "
              "only (not with --server)", file=sys.stderr)
        return 2
    if not args.server:
        sizes.update(shvs=args.shvs, profile_path=args.profile, top_p=args.top_p)
    else:
        sizes.update(row_transport=args.row_transport)
    sizes.update(handoff=args.handoff)
    try:
        SamplingParams(top_p=args.top_p).validate()
    except ValueError as error:
        print(f"simple-sampler bench serve-sim: {error}", file=sys.stderr)
        return 2
    run = serve_sim.run_server if args.server else serve_sim.run
    report = run(vocab=args.vocab, dtype=args.dtype, step_ms=args.step_ms,
                 instances=args.instances, **sizes)
    print_report(args, report, serve_sim.format_report(report))
    return 0


def bench_serve_cost(args: argparse.Namespace) -> int:
    from .bench import serve_cost

    if args.quick:
        configs = serve_cost.plan(paces=["instant"], batches=[16], intervals=[1, 4])
        max_tokens = 32
    else:
        configs = serve_cost.plan(args.pace, args.batch, args.stream_interval, args.routes)
        max_tokens = args.max_tokens
    if not configs or min(c.stream_interval for c in configs) < 1:
        print("simple-sampler bench serve-cost: nothing to run, or a stream interval < 1",
              file=sys.stderr)
        return 2
    largest = max(c.stream_interval for c in configs)
    if max_tokens < serve_cost.RESPONSES_PER_REQUEST * largest:
        # tokens arrive k at a time: a window of a few responses per stream
        # would count a burst more or less
        print(f"simple-sampler bench serve-cost: --max-tokens must be at least "
              f"{serve_cost.RESPONSES_PER_REQUEST} x the largest stream interval "
              f"({serve_cost.RESPONSES_PER_REQUEST * largest}), got {max_tokens}",
              file=sys.stderr)
        return 2
    report = serve_cost.run(configs, max_tokens=max_tokens, instances=args.instances,
                            micro_batches=args.micro_batches, vocab=args.vocab, dtype=args.dtype,
                            profile_dir=args.profile, sampling_mode=args.sampling_mode,
                            shard_min_rows=args.sampler_shard_min_rows,
                            python_thread_pools=args.python_thread_pool,
                            handoffs=args.handoff)
    print_report(args, report, serve_cost.format_report(report))
    return 0


def bench_serve_gpu(args: argparse.Namespace) -> int:
    from .bench import serve_gpu

    sizes = {"batches": [8, 16], "warmup": 2, "measure": 6} if args.quick else \
        {"batches": args.batch}
    try:
        report = serve_gpu.run(args.model, args.dtype, instances=args.instances,
                               top_p=args.top_p, random_weights=args.random_weights,
                               model_config=args.model_config, engine=args.engine,
                               rows=args.rows, **sizes)
    except (RuntimeError, ValueError, FileNotFoundError) as error:  # no CUDA, a dtype it
        # lacks, --random-weights without --model or a directory without config.json
        print(f"simple-sampler bench serve-gpu: {error}", file=sys.stderr)
        return 2
    print_report(args, report, serve_gpu.format_report(report))
    return 0


def bench_serve_gpu_served(args: argparse.Namespace) -> int:
    from .bench import serve_gpu_served as served

    sizes = {"batches": [4], "top_ps": [0.95], "max_tokens": 16} if args.quick else \
        {"batches": args.batch, "top_ps": args.top_p, "max_tokens": args.max_tokens}
    try:
        report = served.run(args.device, args.model_config, args.model, args.dtype,
                            modes=[m for m in served.MODES if m.name in args.modes],
                            instances=args.instances, micro_batches=args.micro_batches,
                            stream_interval=args.stream_interval, log_dir=args.log_dir,
                            **sizes)
    except (RuntimeError, ValueError, FileNotFoundError) as error:  # no CUDA, a bad shape
        print(f"simple-sampler bench serve-gpu-served: {error}", file=sys.stderr)
        return 2
    if args.markdown:
        Path(args.markdown).write_text(served.format_report(report) + "\n")
    print_report(args, report, served.format_report(report))
    return 0


def perf(args: argparse.Namespace) -> int:
    from .bench import perf as perf_bench

    try:
        binary = perf_bench.find_perf_analyzer(args.perf_analyzer)
        report = perf_bench.run(binary, concurrencies=args.concurrency, modes=args.modes,
                                inputs=args.input_data, export_dir=args.export_dir,
                                instances=args.instances,
                                stability_percent=args.stability_percent)
    except perf_bench.PerfError as error:
        print(f"simple-sampler perf: {error}", file=sys.stderr)
        return 1
    print_report(args, report, perf_bench.format_table(report))
    return 0


def build_report(args: argparse.Namespace) -> int:
    from . import report

    try:
        markdown = report.build(args.files, args.output_dir)
    except report.ReportError as error:
        print(f"simple-sampler report: {error}", file=sys.stderr)
        return 2
    print(markdown)
    return 0


def hot_vocab_profile(args: argparse.Namespace) -> str:
    """--hot-vocab auto: the shipped SmolLM2 profile when serving SmolLM2, or
    an engine without a model (simulated) hot-first, mapped to its rows' ids."""
    modelless = (not engine_spec(args.engine or LlmSettings.engine).runs_model
                 and args.handoff != "hot-first")
    if args.hot_vocab == "off" or (args.hot_vocab == "auto" and (
            args.sampler_only or args.model or modelless)):
        return ""
    return "hot_vocab.npz" if args.hot_vocab == "auto" else str(Path(args.hot_vocab).resolve())


def serve(args: argparse.Namespace) -> int:
    from . import logs
    from .launch import serve as serving

    logs.configure(args.log_level)
    sampler = SamplerSettings.from_arguments(args, hot_vocab_profile=hot_vocab_profile(args))
    # Without --sampler-shards (or with 0), one shard per local sampler instance.
    llm = LlmSettings.from_arguments(
        args, sampler_shards=args.sampler_shards or sampler.sampler_instances,
        hot_vocab_profile=sampler.hot_vocab_profile)
    dtype = None if args.sampler_only else engine_spec(llm.engine).logits_dtype(llm)
    if dtype is not None:
        # The sampler takes the engine's rows as they are (no cast).
        if args.logits_dtype not in (None, dtype):
            print(f"simple-sampler serve: --logits-dtype {args.logits_dtype} differs from the "
                  f"{llm.engine} engine's logits ({dtype})", file=sys.stderr)
            return 2
        sampler = dataclasses.replace(sampler, logits_dtype=dtype)
    return serving.run(sampler, args.http_port, args.grpc_port, args.metrics_port,
                       llm=None if args.sampler_only else llm,
                       repository=args.model_repository, log_path=args.log, demo=args.demo,
                       shutdown_grace_s=llm.shutdown_grace_s, log_level=args.log_level,
                       startup_timeout=args.startup_timeout,
                       frontend=FrontendSettings.from_arguments(args).validate())


#: `generate` options: the ensemble's numeric scalar inputs (the seed as
#: --seed, random_seed's alias).
GENERATION_FLAGS = tuple(t for t in ENSEMBLE.inputs if t.scalar and t.name != "random_seed"
                         and t.dtype not in ("BOOL", "BYTES"))


def generate(args: argparse.Namespace) -> int:
    from .client import GenerateClient, GenerationError

    params = {t.name: getattr(args, t.name) for t in GENERATION_FLAGS}
    params.update(stop_words=args.stop or None, bad_words=args.bad or None,
                  apply_chat_template=not args.raw, exclude_input_in_output=True)
    client = GenerateClient(args.url, args.protocol)
    try:
        if args.stream:
            for chunk in client.stream(args.prompt, **params):
                print(chunk.text, end="", flush=True)
            print()
        else:
            print(client.generate(args.prompt, **params).text)
    except GenerationError as error:
        print(f"simple-sampler generate: {error}", file=sys.stderr)
        return 1
    return 0


def fill_template(args: argparse.Namespace) -> int:
    from .launch import templates

    try:
        templates.fill_file(args.input, templates.parse_assignments(args.values), args.output)
    except (ValueError, OSError) as error:
        print(f"simple-sampler fill-template: {error}", file=sys.stderr)
        return 2
    return 0


def simulated_rows(parser: argparse.ArgumentParser) -> None:
    """--vocab and --dtype of the simulated engine's rows (its settings' choices)."""
    fields = {f.name: f for f in LlmSettings.settings_fields()}
    parser.add_argument("--vocab", type=int, default=LlmSettings.sim_vocab,
                        choices=fields["sim_vocab"].metadata["choices"])
    parser.add_argument("--dtype", default=LlmSettings.sim_dtype,
                        choices=fields["sim_dtype"].metadata["choices"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simple-sampler", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print their figures")
    targets = bench.add_subparsers(dest="target", required=True)
    kernels = targets.add_parser("kernels", help="kernel us/row against torch sort and a numpy floor")
    kernels.add_argument("--quick", action="store_true", help="fewer repeats (under a minute)")
    kernels.add_argument("--json", action="store_true", help="print one JSON object")
    kernels.add_argument("--batch", type=int, default=64)
    kernels.add_argument("--vocab", type=int, nargs="+", default=[49_152, 128_256, 151_936])
    kernels.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                         choices=["float32", "bfloat16"])
    kernels.add_argument("--repeats", type=int, default=20)
    kernels.add_argument("--temperature", type=float, nargs="+", default=None,
                         help="the sampled configs' temperatures, each a set of cells (default:"
                              " theirs, 0.8 and 1)")
    kernels.add_argument("--rows", nargs="+", default=None, choices=["flat", "heavy", "fitted", "real"],
                         help="row kinds, each a set of cells (default: real SmolLM2 rows at"
                              " V=49,152, fitted ones elsewhere)")
    kernels.add_argument("--threads", type=int, default=1,
                         help="threads for the kernels, torch and vLLM (the floor stays at 1)")
    kernels.add_argument("--peer-python", default=None,
                         help="a python that imports vllm, for the vllm_cpu column (default: "
                              "this one if it can, else .peer/bin/python from `make peer`)")
    kernels.add_argument("--no-peer", action="store_true", help="leave the vllm_cpu column out")
    kernels.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                         help="wall: elapsed time; cpu: the process's CPU time (all threads "
                              "summed), for single-threaded runs on a machine others share")
    kernels.set_defaults(handler=bench_kernels)
    server_bench = targets.add_parser(
        "sampler-server", help="rows/s through a real Triton server for 1..N sampler instances")
    server_bench.add_argument("--json", action="store_true", help="print one JSON object")
    server_bench.add_argument("--instances", type=int, default=2, help="largest instance count")
    server_bench.add_argument("--batch", type=int, default=64)
    server_bench.add_argument("--vocab", type=int, default=49_152)
    server_bench.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    server_bench.add_argument("--endpoints", type=int, default=0, metavar="N",
                              help="instead: 1..N sampler-only servers (1 instance each) driven "
                                   "by the decode loop's sampler pool over gRPC")
    server_bench.set_defaults(handler=bench_sampler_server)
    serve_bench = targets.add_parser(
        "serve", help="tokens/s, TTFT, ITL and sampling share through the whole server per mode")
    serve_bench.add_argument("--json", action="store_true", help="print one JSON object")
    serve_bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    serve_bench.add_argument("--modes", nargs="+",
                             default=["simple", "simple_overlap", "inline", "inline_kernels"],
                             choices=["simple", "simple_overlap", "inline", "inline_kernels"])
    serve_bench.add_argument("--max-tokens", type=int, default=64)
    serve_bench.add_argument("--instances", type=int, default=2)
    serve_bench.add_argument("--batch-invariant", nargs="+", default=["off"],
                             choices=["on", "off"],
                             help="engine batch-invariant mode per server ('on off': its cost)")
    serve_bench.set_defaults(handler=bench_serve)

    sim_bench = targets.add_parser(
        "serve-sim", help="decode loop efficiency at GPU pace on a SIMULATED data plane "
                          "(docs/SIMULATED.md)")
    sim_bench.add_argument("--json", action="store_true", help="print one JSON object")
    sim_bench.add_argument("--quick", action="store_true",
                           help="B 8 and 16 and a short window (seconds; for tests)")
    sim_bench.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    simulated_rows(sim_bench)
    sim_bench.add_argument("--step-ms", type=float, default=25.0,
                           help="simulated time of a forward over the whole batch")
    sim_bench.add_argument("--server", action="store_true",
                           help="through a real Triton server (serve --engine simulated) with "
                                "streaming gRPC clients, instead of in-process")
    sim_bench.add_argument("--instances", type=int, default=2,
                           help="kernel threads standing in for simple_sampler instances")
    sim_bench.add_argument("--shvs", action="store_true",
                           help="the kernels use the calibrated hot set mapped into V "
                                "(speculative hot-vocab sampling; in-process only)")
    sim_bench.add_argument("--profile", help="hot-vocabulary profile (.npz) for --shvs; default "
                           "as bench shvs")
    sim_bench.add_argument("--top-p", type=float, default=1.0,
                           help="every request's top_p (default 1: no truncation; in-process "
                                "only)")
    sim_bench.add_argument("--handoff", choices=HANDOFFS, default="full",
                           help="how simple mode's rows cross: full, or hot-first (the engine's "
                                "summary as part of its modelled step)")
    sim_bench.add_argument("--row-transport", choices=ROW_TRANSPORTS, default="arena",
                           help="--server: full rows by the shared-memory arena or inside BLS")
    sim_bench.set_defaults(handler=bench_serve_sim)
    gpu_bench = targets.add_parser(
        "serve-gpu", help="the decode loop over a real model on a CUDA GPU: simple vs "
                          "sampling on the GPU (--engine torch --device cuda; needs CUDA)")
    gpu_bench.add_argument("--json", action="store_true", help="print one JSON object")
    gpu_bench.add_argument("--quick", action="store_true", help="B 8 and 16, a short window")
    gpu_bench.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    gpu_bench.add_argument("--model", help="Hugging Face directory (default SmolLM2-135M)")
    gpu_bench.add_argument("--dtype", default="bfloat16",
                           choices=LlmSettings.__dataclass_fields__["torch_dtype"]
                           .metadata["choices"])
    gpu_bench.add_argument("--instances", type=int, default=2,
                           help="kernel threads standing in for simple_sampler instances")
    gpu_bench.add_argument("--top-p", type=float, nargs="+", default=[0.9],
                           help="every request's top_p, one run per value")
    gpu_bench.add_argument("--model-config",
                           help="a shipped shape (smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, "
                                "llama-3.1-8b) or a config.json: random weights on the device")
    gpu_bench.add_argument("--engine", choices=["static", "eager"], default="static",
                           help="static: static KV cache, CUDA graphs per batch bucket (and "
                                "forward_only, the bound); eager: the Hugging Face forward")
    gpu_bench.add_argument("--rows", nargs="+", choices=["flat", "fitted"], default=["flat"],
                           help="the forward's own rows, or rows fitted to SmolLM2's "
                                "substituted after it")
    gpu_bench.add_argument("--random-weights", action="store_true",
                           help="--model's architecture and tokenizer with fresh weights (its "
                                "config.json and tokenizer files suffice): its step times, "
                                "not its tokens")
    gpu_bench.set_defaults(handler=bench_serve_gpu)

    served_bench = targets.add_parser(
        "serve-gpu-served", help="real servers on the static engine (--device cuda), driven "
        "over gRPC: simple, simple hot-first and inline against the forward-only bound")
    served_bench.add_argument("--model-config", default="llama-3.2-1b",
                              help="a shipped shape or a config.json: RANDOM WEIGHTS")
    served_bench.add_argument("--model", help="a checkpoint directory instead (its weights)")
    served_bench.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                              help="cpu: the tests' runs, figures that mean nothing")
    served_bench.add_argument("--json", action="store_true", help="print one JSON object")
    served_bench.add_argument("--quick", action="store_true",
                              help="B 4, top_p 0.95, 16 tokens (for tests)")
    served_bench.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                              help="default: bfloat16 on cuda, float32 on cpu")
    served_bench.add_argument("--batch", type=_positive_int, nargs="+", default=[64, 256])
    served_bench.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.95])
    served_bench.add_argument("--modes", nargs="+", default=["simple", "simple_hot_first",
                                                             "inline"],
                              choices=["simple", "simple_hot_first", "inline"])
    served_bench.add_argument("--max-tokens", type=_positive_int, default=128)
    served_bench.add_argument("--instances", type=_positive_int, default=2,
                              help="simple_sampler instances")
    served_bench.add_argument("--micro-batches", type=_positive_int, default=1)
    served_bench.add_argument("--stream-interval", type=_positive_int, default=1,
                              help="tokens per response (more: less client and server work)")
    served_bench.add_argument("--log-dir", help="where the servers' logs go (default: a "
                                                "temporary folder, named in the report)")
    served_bench.add_argument("--markdown", metavar="FILE", help="also write the Markdown here")
    served_bench.set_defaults(handler=bench_serve_gpu_served)

    rows_bench = targets.add_parser(
        "row-transport", help="sampler instances' CPU per token by row transport (BLS, "
        "shared-memory arena, hot-first) through a real server on a SIMULATED data plane")
    rows_bench.add_argument("--json", action="store_true", help="print one JSON object")
    rows_bench.add_argument("--quick", action="store_true",
                            help="one small configuration (V=128,256 float32, B=8, 64 tokens each)")
    rows_bench.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    rows_bench.add_argument("--max-tokens", type=_positive_int, default=32,
                            help="tokens per stream (more: /proc's 10 ms CPU ticks weigh less "
                                 "in the per-token figures)")
    rows_bench.add_argument("--transport", nargs="+", default=["bls", "arena", "hot-first"],
                            choices=["bls", "arena", "hot-first"])
    rows_bench.add_argument("--shape", nargs="+", type=_vocab_shape, metavar="V:DTYPE",
                            help="vocabulary sizes and logits dtypes (float32, bfloat16); "
                                 "default: V=151,936 bfloat16, 128,256 float32, 49,152 bfloat16")
    rows_bench.add_argument("--profile", metavar="DIR",
                            help="write each configuration's sampler stub profiles "
                                 "(execute, thread CPU) under DIR (docs/COPIES.md)")
    rows_bench.set_defaults(handler=bench_row_transport)

    cost_bench = targets.add_parser(
        "serve-cost", help="server CPU per streamed token by process, beside Triton's floor "
                           "model, on a SIMULATED data plane (docs/SERVED_COST.md)")
    cost_bench.add_argument("--json", action="store_true", help="print one JSON object")
    cost_bench.add_argument("--quick", action="store_true",
                            help="instant pace, B 16, k 1 and 4, 32 tokens (seconds; for tests)")
    cost_bench.add_argument("--pace", nargs="+", default=["instant", "gpu"],
                            choices=["instant", "gpu"],
                            help="simulated step: instant (0 ms) or gpu (a + b * B, the "
                                 "simulated engine's defaults)")
    cost_bench.add_argument("--batch", type=int, nargs="+", default=[64, 256],
                            help="concurrent streams (B)")
    cost_bench.add_argument("--stream-interval", type=int, nargs="+", default=[1, 4, 16],
                            help="stream_interval of the ensemble's requests (llm direct: the "
                                 "first)")
    routes = ["floor", "floor-llm", "ensemble", "llm"]  # bench.serve_cost.ROUTES (torch: lazy)
    cost_bench.add_argument("--routes", nargs="+", default=routes, choices=routes,
                            help="floor model, the floor model in the llm model's request and "
                                 "response shape, ensemble, llm called directly")
    cost_bench.add_argument("--max-tokens", type=int, default=128,
                            help="tokens per request (at least 8 x the largest stream interval)")
    cost_bench.add_argument("--instances", type=int, default=2, help="simple_sampler instances")
    cost_bench.add_argument("--micro-batches", type=int, nargs="+", default=[2],
                            help="the decode loop's lanes (several: one server each)")
    cost_bench.add_argument("--handoff", nargs="+", choices=HANDOFFS, default=[LlmSettings.handoff],
                            help="rows to the sampler: full, or hot-first's compact rows with "
                                 "the repository's hot set (several: one server each)")
    cost_bench.add_argument("--sampling-mode", default=LlmSettings.sampling_mode,
                            choices=SAMPLING_MODES,
                            help="simple: the sampler instances (a BLS request per shard per "
                                 "step); inline_kernels: in the llm stub, so that tritonserver's "
                                 "column is streaming alone")
    cost_bench.add_argument("--sampler-shard-min-rows", type=int,
                            default=LlmSettings.sampler_shard_min_rows,
                            help="full rows per sampler request at least (1: one request per "
                                 "instance per step, whatever the rows)")
    cost_bench.add_argument("--python-thread-pool", type=int, nargs="+", default=None,
                            metavar="N", help="the Python backend's thread-pool-size, one "
                            "server per size (default: Triton's own, 32, as serve runs it)")
    simulated_rows(cost_bench)
    cost_bench.add_argument("--profile", metavar="DIR",
                            help="run the llm stub's decode-loop thread under cProfile and "
                                 "write DIR/llm-<pid>.prof when each server stops")
    cost_bench.set_defaults(handler=bench_serve_cost)

    shvs = targets.add_parser("shvs", help="speculative hot-vocab sampling against the full path")
    shvs.add_argument("--quick", action="store_true", help="fewer repeats, a smaller profile run")
    shvs.add_argument("--json", action="store_true", help="print one JSON object")
    shvs.add_argument("--profile", help="hot-vocabulary profile (.npz) to use; default: the "
                      "model repository's, else a calibration run")
    shvs.add_argument("--repeats", type=int, default=31)
    shvs.set_defaults(handler=bench_shvs)
    handoff = targets.add_parser("handoff", help="hot-first compact rows against full rows")
    handoff.add_argument("--quick", action="store_true", help="fewer repeats")
    handoff.add_argument("--json", action="store_true", help="print one JSON object")
    handoff.add_argument("--profile", help="hot-vocabulary profile (.npz); default as bench shvs")
    handoff.add_argument("--hot-size", type=int, default=None,
                         help="|H| (default: the profile's chosen size)")
    handoff.add_argument("--cold-top", type=int, default=None,
                         help="each row's largest cold logits handed over with the touched ids "
                              "(default: handoff.DEFAULT_COLD_TOP)")
    handoff.add_argument("--repeats", type=int, default=15)
    handoff.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                         help="as bench kernels' --clock")
    handoff.set_defaults(handler=bench_handoff)
    summary_bench = targets.add_parser(
        "summary-gpu", help="the hot-first summary on the logits' device against the full "
                            "rows' copy to the host and the simulated engine's charge for it")
    summary_bench.add_argument("--json", action="store_true", help="print one JSON object")
    summary_bench.add_argument("--quick", action="store_true",
                               help="V 49,152 float32, B 8, two configs, 3 rounds")
    summary_bench.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                               help="where the rows lie (cpu: this CPU, for a check only)")
    summary_bench.add_argument("--batch", type=_positive_int, nargs="+", default=[64, 256])
    summary_bench.add_argument("--repeats", type=_positive_int, default=20)
    summary_bench.add_argument("--profile", help="hot-vocabulary profile (.npz); default as "
                                                 "bench shvs")
    summary_bench.set_defaults(handler=bench_summary_gpu)
    loop_bench = targets.add_parser(
        "loop", help="the decode loop's own CPU time per step (simulated instant engine and "
                     "sampler) and its batch building against a rebuild per step")
    loop_bench.add_argument("--json", action="store_true", help="print one JSON object")
    loop_bench.add_argument("--batch", type=int, default=256)
    loop_bench.add_argument("--history", type=int, default=1000, help="prompt tokens per row")
    loop_bench.add_argument("--steps", type=int, default=64)
    loop_bench.add_argument("--rounds", type=int, default=3,
                            help="alternated runs per decoder (the median is reported)")
    loop_bench.set_defaults(handler=bench_loop)

    perf_cmd = commands.add_parser(
        "perf", help="perf_analyzer (gRPC streaming) against the ensemble, per sampling mode")
    perf_cmd.add_argument("--json", action="store_true", help="print one JSON object")
    perf_cmd.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    perf_cmd.add_argument("--modes", nargs="+", default=["simple", "inline"],
                          choices=["simple", "simple_overlap", "inline", "inline_kernels"])
    perf_cmd.add_argument("--instances", type=int, default=2, help="simple_sampler CPU instances")
    perf_cmd.add_argument("--perf-analyzer", help="the perf_analyzer binary (default: .perf/, PATH)")
    perf_cmd.add_argument("--input-data", type=Path,
                          help="perf_analyzer input JSON (default: client/perf_inputs.json)")
    perf_cmd.add_argument("--export-dir", type=Path,
                          help="keep perf_analyzer's exports and the server logs here")
    perf_cmd.add_argument("--stability-percent", type=int, default=20)
    perf_cmd.set_defaults(handler=perf)

    report_cmd = commands.add_parser(
        "report", help="Markdown report with PNG plots from the bench commands' --json output")
    report_cmd.add_argument("files", nargs="+", type=Path, metavar="FILE.json",
                            help="--json output of `bench ...` or `perf`, or a perf_analyzer "
                            "profile export")
    report_cmd.add_argument("--output-dir", type=Path, default=Path("results/report"),
                            help="where report.md and the PNGs go (default: results/report)")
    report_cmd.set_defaults(handler=build_report)

    server = commands.add_parser("serve", help="run tritonserver with the SIMPLE model repository")
    server.add_argument("--http-port", type=int, default=8000)
    server.add_argument("--grpc-port", type=int, default=8001)
    server.add_argument("--metrics-port", type=int, default=8002)
    SamplerSettings.add_arguments(server)
    server.add_argument("--model-repository", type=Path,
                        help="serve this repository as it is instead of assembling one")
    server.add_argument("--log", type=Path, help="server log file (default: a temporary file)")
    server.add_argument("--sampler-only", action="store_true",
                        help="serve the simple_sampler model alone (no LLM)")
    LlmSettings.add_arguments(server)
    FrontendSettings.add_arguments(server)
    server.add_argument("--hot-vocab", default="auto", metavar="auto|off|PROFILE.npz",
                        help="speculative hot-vocab sampling profile (auto: the shipped one "
                             "for the default model)")
    server.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="the launcher's and every model's log level (model lines go to "
                             "the server log)")
    server.add_argument("--startup-timeout", type=float, metavar="SECONDS",
                        help="how long to wait for the models to load (default: 1800 with "
                             "--engine tensorrt_llm, which builds its engine at start; else 180)")
    server.add_argument("--demo", metavar="PROMPT",
                        help="once ready, stream the answer to PROMPT, then keep serving")
    server.set_defaults(handler=serve)

    gen = commands.add_parser("generate", help="ask a running server; prints the answer")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--url", default="127.0.0.1:8001", help="host:port of --protocol")
    gen.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument("--stop", action="append", help="a stop word (repeatable)")
    gen.add_argument("--bad", action="append", help="a word never to generate (repeatable)")
    for tensor in GENERATION_FLAGS:
        # max_tokens: 64 here, a better first answer than the server's 16.
        default = 64 if tensor.name == "max_tokens" else None
        gen.add_argument(f"--{tensor.name.replace('_', '-')}",
                         type=float if tensor.dtype.startswith("FP") else int, default=default,
                         help=f"{tensor.allowed} (default: {default or tensor.default})")
    gen.set_defaults(handler=generate)

    check = commands.add_parser("gpu-check", help="the first GPU run, checked end to end "
                                "(docs/GPU.md); --dry-run on the simulated engine")
    gpu_check.add_arguments(check)
    check.set_defaults(handler=gpu_check.main)
    fill = commands.add_parser("fill-template",
                               help="fill ${name} placeholders of a config.pbtxt in place")
    fill.add_argument("-i", "--input", type=Path, required=True)
    fill.add_argument("values", help="name:value,name:value")
    fill.add_argument("-o", "--output", type=Path, help="write here instead of in place")
    fill.set_defaults(handler=fill_template)

    from .bench.calibrate import DEFAULT_OUTPUT, DEFAULT_SIZES
    cal = commands.add_parser("calibrate", help="hot-vocabulary profile and SHVS sizing for SmolLM2")
    cal.add_argument("--output", default=str(DEFAULT_OUTPUT),
                     help="profile path (.npz), next to the sampler's config in the model repository")
    cal.add_argument("--plot", help="PNG path (default: the profile path with .png)")
    cal.add_argument("--prompts", type=int, help="use only the first N calibration prompts")
    cal.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt")
    cal.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                     help="candidate hot-set sizes")
    cal.add_argument("--repeats", type=int, default=9, help="timing repeats per size (median)")
    cal.set_defaults(handler=calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
