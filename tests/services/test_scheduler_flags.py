"""The scheduler's structured-output flags end up in its SchedulerConfig, and a bad backend
name is refused where the config is built."""
from __future__ import annotations

import argparse

import pytest

from services.engine.config import EngineConfig
from services.scheduler import main as scheduler_main
from services.scheduler.config import SchedulerConfig


def test_flags_parse_and_a_bad_backend_is_refused():
    parser = argparse.ArgumentParser()
    scheduler_main.add_arguments(parser)
    args = parser.parse_args(["--model", "/m", "--structured-outputs-backend", "xgrammar"])
    assert (args.model, args.structured_outputs_backend) == ("/m", "xgrammar")
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-outputs-backend", "outlines"])
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        SchedulerConfig(structured_outputs_backend="outlines")
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")
