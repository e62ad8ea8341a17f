"""`kvrelay bench latency` and `kvrelay bench throughput` on the real in-process engine, tiny."""
from __future__ import annotations

import json

from kvrelay.cli import main


def test_latency_sweeps_batch_sizes(tmp_path, capsys):
    code = main(["bench", "latency", "--batch-sizes", "1,3", "--input-len", "12",
                 "--output-len", "3", "--iters", "1", "--warmup-iters", "0",
                 "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "latency.json").read_text())
    one, three = result["rows"]
    assert (one["batch_size"], three["batch_size"]) == (1, 3)
    for row in (one, three):
        # 3 output tokens: the prefill step gives the first, two decode steps the rest.
        assert row["decode_step_s"]["count"] == 2
        assert 0 < row["prefill_s"]["p50"] < row["latency_s"]["p50"]
    assert three["output_tokens_per_s"] > 0
    assert "| 3 |" in capsys.readouterr().out
    assert (tmp_path / "latency.md").exists()


def test_throughput_runs_a_workload_offline(tmp_path, capsys):
    code = main(["bench", "throughput", "--workload", "shared-prefix", "--max-requests", "3",
                 "--max-tokens", "2", "--no-warmup", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    run = result["runs"][0]
    summary = run["summary"]
    assert summary["requests_ok"] == 3 and summary["output_tokens"] == 6  # ignore_eos
    assert summary["prompt_tokens"] > 3 * 200  # the ~1,000-token shared system prompt
    assert summary["itl_s"]["count"] == 3  # one gap per request: two tokens, two steps
    assert summary["output_tokens_per_s"] > 0
    assert result["engine"]["prefix_caching"] is True
    assert (tmp_path / "latency_cdf.png").read_bytes().startswith(b"\x89PNG")
    assert "shared-prefix | 3 / 3 |" in capsys.readouterr().out
