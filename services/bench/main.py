"""`kvrelay bench serve|latency|throughput`.

Each benchmark is its own module with `add_arguments(parser)` and `run(args)`; the modules import
their heavy dependencies (torch, matplotlib) inside `run`, so `kvrelay bench serve` pointed at a
remote server never loads torch.
"""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "serve": ("kvrelay.bench.serve", "drive an OpenAI-compatible server with a workload"),
    "latency": ("kvrelay.bench.latency",
                "in-process engine: batch-size sweep of fixed lengths, time per step"),
    "throughput": ("kvrelay.bench.throughput", "in-process engine: a workload offline, tok/s"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        child = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(child)


def run(args) -> int:
    return importlib.import_module(BENCHMARKS[args.benchmark][0]).run(args)
