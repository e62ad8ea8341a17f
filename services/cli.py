"""The `kvrelay` command: one subcommand per service, `up` for the whole local stack, and
`bench` for the benchmarks.

Each service package has a `main` module with `add_arguments(parser)` and `run(args) -> int`;
every flag is also read from `KVRELAY_<FLAG>` (see services/common/flags.py).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help)
COMMANDS = {
    "gateway": ("kvrelay.gateway.main", "OpenAI REST + public gRPC API"),
    "tokenizer": ("kvrelay.tokenizer.main", "chat templates, tokenization, detokenization"),
    "scheduler": ("kvrelay.scheduler.main", "the engine core: queues, KV blocks, PD handoff"),
    "worker": ("kvrelay.worker.main", "a model worker: --role prefill|decode|both"),
    "certs": ("kvrelay.certs.main", "a CA and per-role certificates for mutual TLS"),
    "up": ("kvrelay.stack.main", "run all five services locally as child processes"),
    "bench": ("kvrelay.bench.main", "benchmarks: serve (any OpenAI server), latency, throughput"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with `only` just that subcommand's flags: each service imports only
    its own module (the gateway never loads torch)."""
    parser = argparse.ArgumentParser(prog="kvrelay", description="kvrelay LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
