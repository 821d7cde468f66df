"""The `simple-sampler` command."""
from __future__ import annotations

import argparse
import json
import sys


def bench_kernels(args: argparse.Namespace) -> int:
    from .bench import kernels, machine

    repeats, baseline_repeats = (5, 1) if args.quick else (args.repeats, 3)
    results = kernels.run(vocabs=args.vocab, batch=args.batch, dtypes=args.dtype,
                          repeats=repeats, baseline_repeats=baseline_repeats)
    if args.json:
        print(json.dumps({"results": results, "machine": machine.describe()}))
    else:
        print(kernels.format_table(results))
        info = machine.describe()
        print(f"\n{info['cpu']}, {info['cores']} cores, {info['date']}: {info['command']}")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
