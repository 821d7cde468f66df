"""The `simple-sampler` command."""
from __future__ import annotations

import argparse
import json
import sys


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
    results = kernels.run(vocabs=args.vocab, batch=args.batch, dtypes=args.dtype,
                          repeats=repeats, baseline_repeats=baseline_repeats)
    print_report(args, {"results": results}, kernels.format_table(results))
    return 0


def bench_shvs(args: argparse.Namespace) -> int:
    from .bench import shvs

    report = shvs.run(profile_path=args.profile, repeats=3 if args.quick else args.repeats,
                      quick=args.quick)
    print_report(args, report, shvs.format_table(report))
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from .shvs import calibrate

    calibrate.main(output=args.output, plot_path=args.plot, prompts=args.prompts,
                   tokens=args.tokens, sizes=args.sizes, repeats=args.repeats)
    return 0


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
    kernels.set_defaults(handler=bench_kernels)
    shvs = targets.add_parser("shvs", help="speculative hot-vocab sampling against the full path")
    shvs.add_argument("--quick", action="store_true", help="fewer repeats, a smaller profile run")
    shvs.add_argument("--json", action="store_true", help="print one JSON object")
    shvs.add_argument("--profile", help="hot-vocabulary profile (.npz) to use; default: the "
                      "model repository's, else a calibration run")
    shvs.add_argument("--repeats", type=int, default=31)
    shvs.set_defaults(handler=bench_shvs)

    from .shvs.calibrate import DEFAULT_OUTPUT, DEFAULT_SIZES
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
