"""Command-line flags that can also come from the environment.

Every flag `--some-name` of every service is also read from `KVRELAY_SOME_NAME`; the command line
wins. The same names work in the local stack, docker compose and Kubernetes.
"""
from __future__ import annotations

import argparse
import os

ENV_PREFIX = "KVRELAY_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *aliases: str, **kwargs) -> None:
    """Like `parser.add_argument`, with the default taken from the flag's environment variable
    (that of `flag`; `aliases` are other spellings on the command line only)."""
    name = env_name(flag)
    raw = os.environ.get(name)
    if raw is not None:
        kwargs["default"] = _parse_env(raw, kwargs, name)
        kwargs.pop("required", None)
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {name}]".strip()
    parser.add_argument(flag, *aliases, **kwargs)


def _parse_env(raw: str, kwargs: dict, name: str):
    if kwargs.get("action") == "store_true":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise SystemExit(f"{name}={raw!r}: expected true or false")
    convert = kwargs.get("type", str)
    try:
        value = convert(raw)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"{name}={raw!r}: {exc}") from None
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise SystemExit(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
    return value


def flag_env_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{flag: env var} for every flag of a parser (used by the manifest checks); an alias has
    no variable of its own."""
    names = {}
    for action in parser._actions:
        options = [option for option in action.option_strings if option.startswith("--")]
        if options and options[0] != "--help":
            names[options[0]] = env_name(options[0])
    return names
