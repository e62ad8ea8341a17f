"""The LoRA flags the scheduler and the workers share (declared here once): whether adapters
may be served at all, and how many one step may mix. Both sides must agree on --max-loras: the
scheduler admits requests so that a worker never needs more slots than it has."""
from __future__ import annotations

import argparse

from kvrelay.common.flags import add_flag

MAX_LORAS_HELP = ("distinct LoRA adapters one worker's running requests may use at once (its "
                  "slots); a request for another waits until one comes free")


def add_enable_lora(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--enable-lora", action="store_true", default=False,
             help="serve LoRA adapters (PEFT format) on the base model: named at start with "
                  "--lora-modules or loaded at run time; a request names one as its model")


def add_max_loras(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--max-loras", type=_positive, default=4, help=MAX_LORAS_HELP)


def add_lora_modules(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--lora-modules", type=_checked_modules, default="",
             help="adapters to load at start: name=path items separated by commas (a path is "
                  "a PEFT directory every worker can read)")


def parse_lora_modules(items: str | None) -> dict[str, str]:
    """`name=path,name=path` (vLLM's --lora-modules items, comma-separated) -> {name: path}."""
    items = [item.strip() for item in (items or "").split(",") if item.strip()]
    modules: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path items, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def _checked_modules(text: str) -> str:
    parse_lora_modules(text)
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value
