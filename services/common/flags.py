"""Command-line flags that can also come from the environment.

Every flag `--some-name` of every service is also read from `KVRELAY_SOME_NAME`; the command line
wins. The same names work in the local stack, docker compose and Kubernetes.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field

ENV_PREFIX = "KVRELAY_"


@dataclass(frozen=True)
class FlagDeclaration:
    """A flag as its service's code declares it: `kwargs` hold the default as written, before
    any KVRELAY_* variable, so other parsers (`kvrelay up`) and the generated docs can reuse it."""
    flag: str
    aliases: tuple[str, ...] = ()
    kwargs: dict = field(default_factory=dict)


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *aliases: str, **kwargs) -> None:
    """Like `parser.add_argument`, with the default taken from the flag's environment variable
    (that of `flag`; `aliases` are other spellings on the command line only)."""
    declaration = FlagDeclaration(flag, aliases, dict(kwargs))
    name = env_name(flag)
    raw = os.environ.get(name)
    if raw is not None:
        kwargs["default"] = _parse_env(raw, kwargs, name)
        kwargs.pop("required", None)
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {name}]".strip()
    action = parser.add_argument(flag, *aliases, **kwargs)
    action.declaration = declaration


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


def flag_from_env(flag: str) -> str | None:
    """The raw value of a flag's variable, for code that runs without the flag's parser (the
    container health check reads the service's TLS flags this way)."""
    return os.environ.get(env_name(flag))


def declared_flags(add_arguments: Callable[[argparse.ArgumentParser], None]
                   ) -> dict[str, FlagDeclaration]:
    """{flag: declaration} of every flag that `add_arguments` adds through `add_flag`, read
    from a throwaway parser."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return {action.declaration.flag: action.declaration for action in parser._actions
            if hasattr(action, "declaration")}
