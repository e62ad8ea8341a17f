"""The scheduler's structured-output flags, and a bad backend name refused where the config is
built. The flags are parsed in a child process: the scheduler's metrics module registers names
the gateway's (imported by other tests here) registers too."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.engine.config import EngineConfig
from kvrelay.scheduler.config import SchedulerConfig

PARSE = """
import argparse, sys
from kvrelay.scheduler import main
parser = argparse.ArgumentParser()
main.add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
print(args.model, args.structured_outputs_backend)
"""


def parse(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PARSE, *argv], capture_output=True, text=True,
                          timeout=60)


def test_flags_parse_and_a_bad_backend_is_refused():
    parsed = parse("--model", "/m", "--structured-outputs-backend", "xgrammar")
    assert parsed.returncode == 0, parsed.stderr
    assert parsed.stdout.split() == ["/m", "xgrammar"]
    refused = parse("--structured-outputs-backend", "outlines")
    assert refused.returncode == 2 and "outlines" in refused.stderr
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        SchedulerConfig(structured_outputs_backend="outlines")
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")
