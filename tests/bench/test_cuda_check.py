"""benchmarks/cuda_check.py runs end to end: on this CPU machine in smoke mode (tiny shapes,
Triton under TRITON_INTERPRET=1), so the script a GPU session runs in one call is known to work
up to the device itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_checks_the_kernels_and_reports_every_part(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "benchmarks.cuda_check", "--smoke", "--out",
                             str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    kernels = {row["kernel"] for row in report["checks"]}
    assert kernels == {"paged attention", "paged attention, 8-bit KV", "store kv", "spec rejection",
                       "moe"}
    assert all(row["ok"] for row in report["checks"])
    assert report["copy_bytes_per_s"] > 0 and report["attention"]
    assert [row["batch"] for row in report["decode_steps"]] == [1, 4]
    assert report["offline"]["output_tokens_per_s"] > 0
    assert report["offline"]["steps"] >= report["offline"]["max_tokens"]
    assert "| decode step: batch |" in result.stdout
