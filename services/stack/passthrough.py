"""The services' flags that `kvrelay up` offers: each is declared once, by its service (its
flags.py), and `up` takes it from there with the same type, choices and help.

A passed-on flag defaults to None in `up`: unset, it stays off the services' command lines and
each keeps its own default (which `up --help` shows). A few flags `up` reads itself and sets on
each service its own way (gateway i serves on --port + i); those keep their service's default.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from kvrelay.common.flags import FlagDeclaration, add_flag, declared_flags

# service -> the module that declares its flags (imports neither torch nor the service itself)
SERVICE_FLAGS = {
    "gateway": "kvrelay.gateway.flags",
    "tokenizer": "kvrelay.tokenizer.flags",
    "scheduler": "kvrelay.scheduler.flags",
    "worker": "kvrelay.worker.flags",
}

# flag -> the services whose command lines get it when set. Its type, choices and help are the
# first service's (--model: the tokenizer's words for it).
PASSED_ON: dict[str, tuple[str, ...]] = {
    "--model": ("tokenizer", "scheduler", "worker"),
    "--chat-template": ("tokenizer",),
    "--tool-call-parser": ("tokenizer",),
    "--served-model-name": ("gateway",),
    "--api-key": ("gateway",),
    "--request-timeout": ("gateway",),
    "--tokenizer-wait-timeout": ("gateway",),
    "--reasoning-parser": ("gateway",),
    "--pooling": ("gateway",),
    "--responses-store-bytes": ("gateway",),
    "--responses-store-ttl": ("gateway",),
    "--dtype": ("worker",),
    "--kv-cache-memory": ("worker",),
    "--kv-cache-memory-fraction": ("worker",),
    "--num-kv-blocks": ("worker",),
    "--kv-cache-dtype": ("worker",),
    "--tensor-parallel-timeout": ("worker",),
    "--pp-layer-partition": ("worker",),
    "--enable-expert-parallel": ("worker",),
    "--int4-max-tokens": ("worker",),
    "--amx-max-tokens": ("worker",),
    "--q4a8-max-tokens": ("worker",),
    "--int8-activations": ("worker",),
    "--max-num-batched-tokens": ("scheduler",),
    "--prefill-max-num-batched-tokens": ("scheduler",),
    "--max-num-seqs": ("scheduler",),
    "--long-prefill-token-threshold": ("scheduler",),
    "--long-prefill-chunk-size": ("scheduler",),
    "--max-long-partial-prefills": ("scheduler",),
    "--shared-prefill-max-num-batched-tokens": ("scheduler",),
    "--no-prefix-caching": ("scheduler",),
    "--enable-lora": ("scheduler", "worker"),
    "--max-loras": ("worker",),
    "--max-lora-rank": ("worker",),
    "--lora-modules": ("scheduler",),
    "--max-cpu-loras": ("scheduler",),
    "--no-async-scheduling": ("scheduler",),
    "--kv-transport": ("scheduler",),
    "--shared-compute-steps": ("scheduler",),
    "--structured-outputs-backend": ("scheduler",),
    "--speculative-config": ("scheduler",),
    "--max-queued-requests": ("scheduler",),
    "--worker-wait-timeout": ("scheduler",),
}
# Paths are made absolute: a service may start in another folder than `up`.
PATH_FLAGS = frozenset({"--chat-template"})

# flag -> (the service that declares it, what `up` does with it); `up` sets it on the services
# itself (plan.py), from this value.
READ_BY_UP: dict[str, tuple[str, str]] = {
    "--port": ("gateway", "gateway i serves on --port + i"),
    "--grpc-port": ("gateway", "gateway i serves on --grpc-port + i"),
    "--log-level": ("gateway", "every service's"),
    "--tensor-parallel-size": ("worker", "every worker's, unless --prefill-/"
                               "--decode-tensor-parallel-size set its role's; its ranks share "
                               "the worker's threads"),
    "--pipeline-parallel-size": ("worker", "every worker's, unless --prefill-/"
                                 "--decode-pipeline-parallel-size set its role's; its stages "
                                 "share the worker's threads"),
    "--nnodes": ("worker", "the colocated worker's, or the pd topology's decode worker's "
                 "(one of it), whose pipeline then spans this host and others"),
    "--dist-init-address": ("worker", "given to that worker"),
}

_PLURAL = {"gateway": "gateways", "tokenizer": "tokenizers", "scheduler": "schedulers",
           "worker": "workers"}


def service_flags(service: str) -> dict[str, FlagDeclaration]:
    """{flag: declaration} of `kvrelay <service>`, as its own flags module declares them."""
    return declared_flags(importlib.import_module(SERVICE_FLAGS[service]).add_arguments)


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """`up`'s flags taken from the services: those it passes on, then those it reads itself."""
    declared = {service: service_flags(service) for service in SERVICE_FLAGS}
    for flag, services in PASSED_ON.items():
        owner = services[0]
        kwargs = _passed_on_kwargs(declared[owner][flag].kwargs, owner, services)
        add_flag(parser, flag, **kwargs)
    for flag, (owner, use) in READ_BY_UP.items():
        kwargs = dict(declared[owner][flag].kwargs)
        kwargs["help"] = _joined(kwargs.get("help", ""), f"{use}")
        add_flag(parser, flag, **kwargs)


def _passed_on_kwargs(kwargs: dict, owner: str, services: tuple[str, ...]) -> dict:
    kwargs = dict(kwargs)
    receivers = _listed([_PLURAL[service] for service in services])
    note = f"passed to the {receivers}"
    if kwargs.get("action") != "store_true":
        if kwargs.get("default") is not None:
            note += f"; default: the {owner}'s, {kwargs['default']}"
        kwargs["default"] = None
        if kwargs.get("type") not in (None, int, float, str):
            kwargs["type"] = _checked_text(kwargs["type"])
    kwargs["help"] = _joined(kwargs.get("help", ""), note)
    return kwargs


def _checked_text(convert):
    """The service's own check of a value, keeping the text: it travels on a command line,
    where the service converts it again."""
    def check(text: str) -> str:
        convert(text)
        return text
    check.__name__ = getattr(convert, "__name__", "value")  # argparse names it in errors
    return check


def _joined(help_text: str, note: str) -> str:
    return f"{help_text} ({note})" if help_text else note


def _listed(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def passed_on_argv(args: argparse.Namespace, service: str) -> list[str]:
    """The passed-on flags the user set, as `service`'s command line takes them."""
    argv = []
    for flag, services in PASSED_ON.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if service not in services or value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, str(Path(value).resolve()) if flag in PATH_FLAGS else str(value)]
    return argv
