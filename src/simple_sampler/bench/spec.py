"""What one bench declares, so that `simple-sampler bench NAME` and
`simple-sampler report` are both built from it (docs/INTERNALS.md, "Adding
a bench").

A spec is a bench package's `__init__` (bench/NAME/), a light module:
building the command line imports every spec, and its measuring module
(bench/NAME/measuring.py) may import torch, so a spec imports it only inside
`measure` and `table`.
Options the command line leaves out are not passed to the module's run(),
whose signature keeps their defaults (`given`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from ..settings import SIMULATED_DTYPES, LlmSettings
from .markdown import FigureWriter, Source


class UsageError(ValueError):
    """Options that cannot run together; the command exits with 2."""


@dataclass(frozen=True)
class BenchSpec:
    """One bench.

    name: its subcommand, and the "kind" of its --json output.
    help: the subcommand's help.
    heading: its section's heading in `report`.
    arguments: adds its own options to its subparser (--json, and --quick
        where `quick` says what it means, come from the command line).
    measure: runs it with the parsed options; returns the report (a dict).
    table: the report as the terminal's text.
    section: the report as Markdown lines, its figures saved by the writer.
    quick: --quick's help (the sizes it sets are the spec module's QUICK
        constants); None where the bench has no --quick.
    errors: exceptions meaning "cannot run here" (no CUDA, ...): a message
        and exit 2, as UsageError.
    """
    name: str
    help: str
    heading: str
    arguments: Callable[[argparse.ArgumentParser], None]
    measure: Callable[[argparse.Namespace], dict]
    table: Callable[[dict], str]
    section: Callable[[Source, FigureWriter], list[str]]
    quick: str | None = None
    errors: tuple[type[Exception], ...] = ()


def given(args: argparse.Namespace, **options: str) -> dict:
    """run()'s keyword arguments (keyword=option name) from the options the
    command line set; one left out keeps run()'s default."""
    return {keyword: getattr(args, option) for keyword, option in options.items()
            if getattr(args, option) is not None}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def vocab_shape(text: str) -> tuple[int, str]:
    """V:DTYPE (a simulated engine's vocabulary and logits dtype)."""
    vocab, _, dtype = text.partition(":")
    if not vocab.isdigit() or int(vocab) < 1 or dtype not in SIMULATED_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected V:DTYPE with V >= 1 and DTYPE one of {', '.join(SIMULATED_DTYPES)}")
    return int(vocab), dtype


def simulated_rows(parser: argparse.ArgumentParser) -> None:
    """--vocab and --dtype of the simulated engine's rows (its settings' defaults and choices)."""
    fields = {f.name: f for f in LlmSettings.settings_fields()}
    parser.add_argument("--vocab", type=int, default=LlmSettings.sim_vocab,
                        choices=fields["sim_vocab"].metadata["choices"])
    parser.add_argument("--dtype", default=LlmSettings.sim_dtype,
                        choices=fields["sim_dtype"].metadata["choices"])
