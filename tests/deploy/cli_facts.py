"""What the deploy files are checked against: the CLI's real flags and the code's real metrics.

Both are read from the code itself (the parsers the services build, an AST scan of the metric
definitions), so renaming a flag or a metric makes the manifests' tests fail until they follow.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from services.cli import COMMANDS, build_parser
from services.common.flags import env_name, flag_env_names

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "tokenizer", "scheduler", "worker")
ENV_NAME = re.compile(r"^KVRELAY_[A-Z0-9_]+$")


@functools.cache
def service_parser(command: str):
    """The argparse parser of one `kvrelay <command>`."""
    parser = build_parser(only=command)
    subparsers = next(action for action in parser._actions if action.choices)
    return subparsers.choices[command]


@functools.cache
def flag_envs(command: str) -> frozenset[str]:
    """Every KVRELAY_* variable that sets a flag of `kvrelay <command>`."""
    return frozenset(flag_env_names(service_parser(command)).values())


@functools.cache
def flag_default(command: str, env: str):
    """The default of the flag that `env` sets (without any KVRELAY_* in this environment)."""
    parser = service_parser(command)
    for action in parser._actions:
        if any(env_name(option) == env for option in action.option_strings):
            return action.default
    raise KeyError(env)


@functools.cache
def direct_envs() -> frozenset[str]:
    """KVRELAY_* variables the code reads itself, not through a flag (KVRELAY_CACHE_DIR, the
    native-kernel switches...): every string literal of that shape in services/ and kernels/."""
    names = set()
    for folder in ("services", "kernels"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and ENV_NAME.match(node.value)):
                    names.add(node.value)
    return frozenset(names)


def subcommand(tokens: list[str]) -> str | None:
    """The kvrelay subcommand a container runs, from its command/args tokens."""
    for token in tokens:
        if token in COMMANDS:
            return token
    return None


def unknown_envs(command: str, names) -> list[str]:
    """The KVRELAY_* names among `names` that neither set a flag of `command` nor are read
    directly by the code."""
    known = flag_envs(command) | direct_envs()
    return sorted(name for name in names if name.startswith("KVRELAY_") and name not in known)


def addresses(value: str) -> list[tuple[str, int]]:
    """(host, port) of each address in a flag value: comma-separated, `dns:///` allowed."""
    result = []
    for item in value.split(","):
        item = item.strip().removeprefix("dns:///")
        if item:
            host, _, port = item.rpartition(":")
            result.append((host, int(port)))
    return result


# ---- metrics ------------------------------------------------------------------------------------
_KINDS = ("counter", "gauge", "histogram")


@functools.cache
def metric_families() -> dict[str, tuple[str, frozenset[str]]]:
    """{"kvrelay:<name>": (kind, label names)} for every metric defined through
    services.common.metrics' counter/gauge/histogram helpers."""
    families = {}
    for path in (REPO / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in _KINDS or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            labels = node.args[2] if len(node.args) > 2 else next(
                (kw.value for kw in node.keywords if kw.arg == "labels"), None)
            label_names = frozenset(ast.literal_eval(labels)) if labels is not None else frozenset()
            # One name may be defined by two services (generation_tokens: the gateway's
            # delivered tokens, the scheduler's sampled ones); either's labels may be queried.
            _, seen = families.get(f"kvrelay:{first.value}", (name, frozenset()))
            families[f"kvrelay:{first.value}"] = (name, label_names | seen)
    return families


@functools.cache
def metric_series() -> dict[str, frozenset[str]]:
    """{exposed series name: label names}, as prometheus_client exposes each family: counters
    as <name>_total (it strips a _total the code already wrote), histograms as _bucket (plus
    the `le` label), _sum and _count."""
    series = {}
    for family, (kind, labels) in metric_families().items():
        if kind == "counter":
            series[family.removesuffix("_total") + "_total"] = labels
        elif kind == "gauge":
            series[family] = labels
        else:
            series[family + "_bucket"] = labels | {"le"}
            series[family + "_sum"] = labels
            series[family + "_count"] = labels
    return series
