"""`kvrelay up` takes the services' flags from the services' own declarations (stack/
passthrough.py): none is written twice, each reaches a service that declares it, and reading
them loads neither torch nor the worker's OpenMP setting into `up`'s own process."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvrelay.common.flags import declared_flags
from kvrelay.stack import main as stack_main
from kvrelay.stack.passthrough import PASSED_ON, READ_BY_UP, SERVICE_FLAGS, service_flags
from kvrelay.stack.plan import plan_stack

# up's own flags that a service also has, with another meaning or default on purpose
UP_OWN_NAMESAKES = {"--host"}  # the stack binds loopback; a service alone every interface


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    stack_main.add_arguments(parser)
    return parser


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(action for action in parser._actions if flag in action.option_strings)


def test_every_service_flag_up_offers_comes_from_the_services():
    up_flags = set(declared_flags(stack_main.add_arguments))
    service = set().union(*(service_flags(name) for name in SERVICE_FLAGS))
    taken = set(PASSED_ON) | set(READ_BY_UP)
    assert up_flags & service == taken | UP_OWN_NAMESAKES


@pytest.mark.parametrize("flag", sorted(PASSED_ON))
def test_a_passed_on_flag_is_declared_by_every_service_that_gets_it(flag):
    for service in PASSED_ON[flag]:
        assert flag in service_flags(service), f"{service} has no {flag}"


@pytest.mark.parametrize("flag", sorted(PASSED_ON))
def test_a_passed_on_flag_has_its_services_type_and_choices(flag):
    owner = service_flags(PASSED_ON[flag][0])[flag].kwargs
    action = _option(_up_parser(), flag)
    assert action.choices == owner.get("choices")
    if owner.get("type") in (int, float):
        assert action.type is owner["type"]


def test_up_help_shows_the_workers_own_default():
    worker_default = service_flags("worker")["--amx-max-tokens"].kwargs["default"]
    assert f"the worker's, {worker_default})" in _option(_up_parser(), "--amx-max-tokens").help


def test_a_passed_on_flag_from_the_environment_reaches_the_worker(monkeypatch):
    monkeypatch.setenv("KVRELAY_AMX_MAX_TOKENS", "16")
    specs = {spec.name: spec for spec in plan_stack(_up_parser().parse_args([]))}
    argv = specs["decode-0"].argv
    assert argv[argv.index("--amx-max-tokens") + 1] == "16"
    assert "--amx-max-tokens" not in specs["scheduler"].argv


def test_a_speculative_config_is_checked_by_up_and_passed_on_as_typed():
    parser = _up_parser()
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    specs = {spec.name: spec for spec in plan_stack(parser.parse_args(
        ["--speculative-config", text]))}
    argv = specs["scheduler"].argv
    assert argv[argv.index("--speculative-config") + 1] == text
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "nope"}'])


def test_reading_the_service_flags_loads_no_torch_and_leaves_the_environment_alone():
    probe = ("import argparse, os, sys\n"
             "from kvrelay.stack import main\n"
             "main.add_arguments(argparse.ArgumentParser())\n"
             "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "None"]
