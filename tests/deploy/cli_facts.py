"""What the deploy files are checked against: the CLI's real flags and the code's real metrics.

Both are read from the code itself (the parsers the services build, an AST scan of the metric
definitions), so renaming a flag or a metric makes the manifests' tests fail until they follow.
"""
from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from kvrelay.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "tokenizer", "scheduler", "worker")
ENV_NAME = re.compile(r"^KVRELAY_[A-Z0-9_]+$")


# Built in a child process: the services' modules register their Prometheus metrics in one
# shared registry on import, and the gateway's and the scheduler's both define generation_tokens,
# so importing every service here would break other tests in the same pytest process.
_FLAGS_SCRIPT = """
import json
from kvrelay.cli import build_parser
from kvrelay.common.flags import flag_env_names
result = {}
for command in ("gateway", "tokenizer", "scheduler", "worker"):
    parser = build_parser(only=command)
    service = next(action for action in parser._actions if action.choices).choices[command]
    names = flag_env_names(service)
    result[command] = {names[option]: action.default for action in service._actions
                       for option in action.option_strings if option in names}
print(json.dumps(result))
"""


@functools.cache
def _flags() -> dict[str, dict[str, object]]:
    """{subcommand: {KVRELAY_* variable: its flag's default}} from the real parsers."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVRELAY_")}
    done = subprocess.run([sys.executable, "-c", _FLAGS_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"building the CLI parsers failed: {done.stderr}")
    return json.loads(done.stdout)


def flag_envs(command: str) -> frozenset[str]:
    """Every KVRELAY_* variable that sets a flag of `kvrelay <command>`."""
    return frozenset(_flags()[command])


def flag_default(command: str, env: str):
    """The default of the flag that `env` sets (with no KVRELAY_* variable set)."""
    return _flags()[command][env]


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
    kvrelay.common.metrics' counter/gauge/histogram helpers."""
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
