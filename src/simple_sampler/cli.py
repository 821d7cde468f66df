"""The `simple-sampler` command."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .bench.spec import UsageError, given
from .bench import registry
from .launch import gpu_check
from .client.common import OTHER_CLIENTS_INPUTS
from .schema import ENSEMBLE, GUIDE_TYPES, NUM_TOP_LOGPROBS, PROMPT_LOGPROBS
from .serving.engines import engine_spec
from .addresses import check_distinct_ports
from .settings import (SERVED_MODES, SMOLLM2_VOCAB, FrontendSettings, LlmSettings, SamplerSettings,
                       ServerSettings)


def print_report(args: argparse.Namespace, report: dict, table: str) -> None:
    """One JSON object (report plus the machine) with --json, else the table."""
    from .bench import machine

    info = machine.describe()
    if args.json:
        print(json.dumps({**report, "machine": info}))
    else:
        print(table)
        print(f"\n{info['cpu']}, {info['cores']} cores, {info['date']}: {info['command']}")


def run_bench(args: argparse.Namespace) -> int:
    """`bench NAME`: its spec measures and prints; exit 2 where it cannot run here."""
    spec = args.spec
    try:
        report = spec.measure(args)
    except (UsageError, *spec.errors) as error:
        print(f"simple-sampler bench {spec.name}: {error}", file=sys.stderr)
        return 2
    print_report(args, {"kind": spec.name, **report}, spec.table(report))
    return 0


def add_benches(commands) -> None:
    """`bench NAME` for every bench in the registry, each with its spec's options."""
    bench = commands.add_parser("bench", help="benchmarks that print their figures")
    targets = bench.add_subparsers(dest="target", required=True)
    for spec in registry().values():
        parser = targets.add_parser(spec.name, help=spec.help)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        if spec.quick:
            parser.add_argument("--quick", action="store_true", help=spec.quick)
        spec.arguments(parser)
        parser.set_defaults(handler=run_bench, spec=spec)


def calibrate(args: argparse.Namespace) -> int:
    from .bench import calibrate

    calibrate.main(plot_path=args.plot, prompts=args.prompts,
                   **given(args, output="output", tokens="tokens", sizes="sizes",
                           repeats="repeats"))
    return 0


def perf(args: argparse.Namespace) -> int:
    from .bench import perf as perf_bench

    try:
        binary = perf_bench.find_perf_analyzer(args.perf_analyzer)
        report = perf_bench.run(binary, inputs=args.input_data, export_dir=args.export_dir,
                                **given(args, concurrencies="concurrency", modes="modes",
                                        instances="instances",
                                        stability_percent="stability_percent"))
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
    an engine without a model (simulated) hot-first, mapped to its rows' ids;
    with --sampler-only, when its --vocab-size is SmolLM2's, so that a
    sampler host started with defaults holds the hot set of a serving host
    started with defaults (sampler_targets.RemoteSampler checks they agree)."""
    modelless = (not engine_spec(args.engine or LlmSettings.engine).runs_model
                 and args.handoff != "hot-first")
    if args.hot_vocab == "auto" and args.sampler_only:
        return "hot_vocab.npz" if args.vocab_size == SMOLLM2_VOCAB else ""
    if args.hot_vocab == "off" or (args.hot_vocab == "auto" and (args.model or modelless)):
        return ""
    if args.hot_vocab == "auto":
        return "hot_vocab.npz"
    profile = Path(args.hot_vocab)
    if not profile.is_file():
        raise ValueError(f"--hot-vocab {args.hot_vocab!r}: no such profile file (auto, off, or "
                         f"a PROFILE.npz from `simple-sampler calibrate`)")
    return str(profile.resolve())


#: options that act on the launch itself, with or without the models: the
#: drain (--shutdown-grace), how long to wait for the models (--engine), and
#: Triton's shared-memory pool (sized by the sampler's largest request)
LAUNCH_FLAGS = frozenset(("--shutdown-grace", "--engine", "--sampler-max-batch-size",
                          "--vocab-size", "--logits-dtype"))


def refuse_ignored_options(args: argparse.Namespace) -> None:
    """Raise ValueError for options the start would drop: the llm's and the
    front door's with --sampler-only, the models' with --model-repository
    (its config.pbtxt files hold them), LAUNCH_FLAGS excepted."""
    if args.sampler_only:
        dropped = [flag for flag in LlmSettings.given_flags(args) + FrontendSettings.given_flags(args)
                   if flag != "--shutdown-grace"
                   and not (flag == "--openai-port" and args.openai_port == 0)]  # "no API": agreed
        if dropped:
            raise ValueError(f"{', '.join(dropped)} {'apply' if len(dropped) > 1 else 'applies'} "
                             f"to the llm, which --sampler-only does not serve")
    if args.model_repository is not None:
        dropped = [flag for flag in SamplerSettings.given_flags(args) + LlmSettings.given_flags(args)
                   if flag not in LAUNCH_FLAGS] + (
            ["--hot-vocab"] if args.hot_vocab != "auto" else [])
        if dropped:
            raise ValueError(f"{', '.join(dropped)} would not reach the models: "
                             f"--model-repository serves {args.model_repository} as it is (set "
                             f"them in its config.pbtxt files)")


def serve(args: argparse.Namespace) -> int:
    from . import logs
    from .launch import serve as serving

    logs.configure(args.log_level)
    try:
        refuse_ignored_options(args)
        server = ServerSettings.from_arguments(args).validate()
        frontend = FrontendSettings.from_arguments(args).validate()
        check_distinct_ports(**vars(server), openai_port=0 if args.sampler_only
                             else frontend.openai_port)
        sampler = SamplerSettings.from_arguments(args, hot_vocab_profile=hot_vocab_profile(args))
        # Without --sampler-shards (or with 0), one shard per local sampler instance.
        llm = LlmSettings.from_arguments(
            args, sampler_shards=args.sampler_shards or sampler.sampler_instances,
            hot_vocab_profile=sampler.hot_vocab_profile)
        if args.handoff is not None and not args.sampler_only and llm.hot_first_unavailable():
            # asked for by name: not quietly served with full rows (the model only warns)
            raise ValueError(f"--handoff hot-first: {llm.hot_first_unavailable()}")
    except ValueError as error:
        print(f"simple-sampler serve: {error}", file=sys.stderr)
        return 2
    # a repository's own engine is in its files, not on this command line:
    # --logits-dtype (or fp32) sizes the pool as given
    dtype = None if args.sampler_only or args.model_repository is not None else \
        engine_spec(llm.engine).logits_dtype(llm)
    if dtype is not None:
        # The sampler takes the engine's rows as they are (no cast).
        if args.logits_dtype not in (None, dtype):
            print(f"simple-sampler serve: --logits-dtype {args.logits_dtype} differs from the "
                  f"{llm.engine} engine's logits ({dtype})", file=sys.stderr)
            return 2
        sampler = dataclasses.replace(sampler, logits_dtype=dtype)
    return serving.run(sampler, server.http_port, server.grpc_port, server.metrics_port,
                       llm=None if args.sampler_only else llm,
                       repository=args.model_repository, log_path=args.log, demo=args.demo,
                       shutdown_grace_s=llm.shutdown_grace_s, log_level=args.log_level,
                       startup_timeout=args.startup_timeout, frontend=frontend)


#: `generate` options: the ensemble's numeric scalar inputs (the seed as
#: --seed, random_seed's alias), but the logprob asks: generate prints text.
GENERATION_FLAGS = tuple(t for t in ENSEMBLE.inputs if t.scalar and t.name != "random_seed"
                         and t.name not in OTHER_CLIENTS_INPUTS
                         and t.dtype not in ("BOOL", "BYTES")
                         and t.name not in (NUM_TOP_LOGPROBS.name, PROMPT_LOGPROBS.name))


def generate(args: argparse.Namespace) -> int:
    from .client import GenerateClient, GenerationError

    params = {t.name: getattr(args, t.name) for t in GENERATION_FLAGS}
    if params["top_p"] is None and params["top_k"] is None:
        params["top_p"] = 1.0  # sampled: the server reads neither as greedy (TensorRT-LLM's)
    # --stop as vLLM's stop, matched in the text (the stop_words input's words: as tokens)
    params.update(sampling_parameters=json.dumps({"stop": args.stop}) if args.stop else None,
                  bad_words=args.bad or None, apply_chat_template=not args.raw,
                  exclude_input_in_output=True, guided_decoding_guide_type=args.guide_type,
                  guided_decoding_guide=args.guide)
    # a url's scheme names its protocol when --protocol does not
    scheme = args.url.split("://")[0].lower() if args.url and "://" in args.url else ""
    protocol = args.protocol or ("http" if scheme in ("http", "https") else "grpc")
    port = ServerSettings.http_port if protocol == "http" else ServerSettings.grpc_port
    try:
        client = GenerateClient(args.url or f"127.0.0.1:{port}", protocol)
    except ValueError as error:
        print(f"simple-sampler generate: {error}", file=sys.stderr)
        return 2
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simple-sampler", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_benches(commands)
    add_tools(commands)
    add_serving(commands)
    return parser


def add_tools(commands) -> None:
    """perf, report and calibrate: the measuring commands that are no bench."""
    perf_cmd = commands.add_parser(
        "perf", help="perf_analyzer (gRPC streaming) against the ensemble, per sampling mode")
    perf_cmd.add_argument("--json", action="store_true", help="print one JSON object")
    perf_cmd.add_argument("--concurrency", type=int, nargs="+")
    perf_cmd.add_argument("--modes", nargs="+", choices=SERVED_MODES)
    perf_cmd.add_argument("--instances", type=int, help="simple_sampler CPU instances")
    perf_cmd.add_argument("--perf-analyzer", help="the perf_analyzer binary (default: .perf/, PATH)")
    perf_cmd.add_argument("--input-data", type=Path,
                          help="perf_analyzer input JSON (default: client/perf_inputs.json)")
    perf_cmd.add_argument("--export-dir", type=Path,
                          help="keep perf_analyzer's exports and the server logs here")
    perf_cmd.add_argument("--stability-percent", type=int)
    perf_cmd.set_defaults(handler=perf)

    report_cmd = commands.add_parser(
        "report", help="Markdown report with PNG plots from the bench commands' --json output")
    report_cmd.add_argument("files", nargs="+", type=Path, metavar="FILE.json",
                            help="--json output of `bench ...` or `perf`, or a perf_analyzer "
                            "profile export")
    report_cmd.add_argument("--output-dir", type=Path, default=Path("results/report"),
                            help="where report.md and the PNGs go (default: results/report)")
    report_cmd.set_defaults(handler=build_report)

    cal = commands.add_parser("calibrate", help="hot-vocabulary profile and SHVS sizing for SmolLM2")
    cal.add_argument("--output", help="profile path (.npz); default: next to the sampler's "
                     "config in the model repository")
    cal.add_argument("--plot", help="PNG path (default: the profile path with .png)")
    cal.add_argument("--prompts", type=int, help="use only the first N calibration prompts")
    cal.add_argument("--tokens", type=int, help="tokens generated per prompt")
    cal.add_argument("--sizes", type=int, nargs="+", help="candidate hot-set sizes")
    cal.add_argument("--repeats", type=int, help="timing repeats per size (median)")
    cal.set_defaults(handler=calibrate)


def add_serving(commands) -> None:
    """serve, generate, gpu-check and fill-template."""
    server = commands.add_parser("serve", help="run tritonserver with the SIMPLE model repository")
    ServerSettings.add_arguments(server)
    SamplerSettings.add_arguments(server)
    server.add_argument("--model-repository", type=Path,
                        help="serve this repository as it is instead of assembling one")
    server.add_argument("--log", type=Path, help="server log file (default: a temporary file)")
    server.add_argument("--sampler-only", action="store_true",
                        help="serve the simple_sampler model alone (no LLM)")
    LlmSettings.add_arguments(server)
    FrontendSettings.add_arguments(server)
    server.add_argument("--hot-vocab", default="auto", metavar="auto|off|PROFILE.npz",
                        help="speculative hot-vocab sampling profile (auto: the shipped "
                             "SmolLM2 one where SmolLM2's vocabulary is served: the default "
                             "model, --engine simulated --handoff hot-first, --engine static, "
                             "--sampler-only --vocab-size 49152; off otherwise; "
                             "docs/CONFIGURATION.md)")
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
    gen.add_argument("--url", help=f"host:port of --protocol, or http(s)://host:port (default: "
                     f"127.0.0.1:{ServerSettings.grpc_port} for grpc, "
                     f"{ServerSettings.http_port} for http)")
    gen.add_argument("--protocol", choices=["grpc", "http"],
                     help="default: http for an http(s):// --url, else grpc")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument("--stop", action="append",
                     help="a stop string, matched in the text, cut before it (repeatable)")
    gen.add_argument("--bad", action="append", help="a word never to generate (repeatable)")
    gen.add_argument("--guide-type", choices=list(GUIDE_TYPES),
                     help="hold the answer to a grammar (docs/STRUCTURED.md): " + "; ".join(
                         f"{kind}: --guide is {what}" for kind, what in GUIDE_TYPES.items()))
    gen.add_argument("--guide", help="the grammar --guide-type names")
    for tensor in GENERATION_FLAGS:
        # max_tokens: 64 here, a better first answer than the server's 16;
        # and never 0, which only prompt_logprobs allows
        default = 64 if tensor.name == "max_tokens" else None
        allowed = ">= 1, shortened to what the context leaves" if tensor.name == "max_tokens" \
            else tensor.allowed
        said = {"top_p": "1.0 unless --top-k is given; neither is greedy"}.get(tensor.name)
        gen.add_argument(f"--{tensor.name.replace('_', '-')}",
                         type=float if tensor.dtype.startswith("FP") else int, default=default,
                         help=f"{allowed} (default: {said or default or tensor.default})")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
