"""The comparison's markdown, and the refresh of BENCHMARKS.md's marked section."""
from __future__ import annotations

from benchmarks import compare, compare_report
from kvrelay.bench.metrics import Slo, summarize
from kvrelay.bench.records import RequestRecord

BODY_ONE = "| a | 1 |\n"
BODY_TWO = "| b | 2 |\n"


def test_refresh_appends_a_section_once_then_replaces_only_it():
    document = "# Benchmarks\n\nHand-written numbers.\n"
    first = compare_report.refresh_section(document, BODY_ONE)
    assert first.startswith(document.rstrip())
    assert compare_report.SECTION_TITLE in first and BODY_ONE.strip() in first
    edited = first + "\n## A later hand-written section\n"
    second = compare_report.refresh_section(edited, BODY_TWO)
    assert BODY_ONE.strip() not in second and BODY_TWO.strip() in second
    assert second.count(compare_report.BEGIN) == 1
    assert second.count(compare_report.SECTION_TITLE) == 1
    assert second.endswith("## A later hand-written section\n")
    assert "Hand-written numbers." in second


def _result(label: str, phase: str | None = None, itl: float = 0.05) -> dict:
    records = [RequestRecord(i, "short", token_times_s=[0.1, 0.1 + itl, 0.1 + 2 * itl],
                             done_s=0.1 + 2 * itl, output_tokens=3, prompt_tokens=5,
                             usage_reported=True) for i in range(4)]
    summary = summarize(records, 1.0, Slo())
    return {"label": label, "phase": phase, "rate": None, "summary": summary,
            "by_tag": {"short": summary}}


def test_section_has_every_system_workload_and_failure():
    systems = [{"name": "kvrelay pd", "info": {"version": "kvrelay abc", "dtype": "bfloat16",
                                               "threads": 2}, "command": ["kvrelay", "up"]},
               {"name": "llama-server", "error": "failed to start: no compiler\nmore"}]
    chat = {"runs": [_result("kvrelay pd: chat-64")]}
    long_short = {"runs": [_result("kvrelay pd: long+short, without long", "without long"),
                           _result("kvrelay pd: long+short, with long", "with long", 0.1)],
                  "long_short_itl_p99_ratio": 2.0}
    static = [{"system": "HF static batching (batch 16, left padding)", "dtype": "bfloat16",
               "threads": 2, "requests": 64, "output_tokens_per_s": 100.0, "wall_s": 80.0}]
    meta = {"date": "2026-11-29", "machine": "2 cores", "command": "python -m benchmarks.compare",
            "seed": 0, "warmup": 64, "slo_ttft": 2.0, "slo_tpot": 0.1,
            "run_errors": [("kvrelay pd", "poisson", "bench serve exited 1")]}
    text = compare_report.section(meta, systems, {"chat-64": [("kvrelay pd", chat)],
                                                  "long+short": [("kvrelay pd", long_short)],
                                                  "poisson": []}, static)
    assert "| kvrelay pd | kvrelay abc | bfloat16 | 2 | `kvrelay up` | ok |" in text
    assert "| llama-server | - | - | - | - | failed to start: no compiler |" in text
    assert "| kvrelay pd: chat-64 | 4 / 4 |" in text
    assert "| HF static batching (batch 16, left padding) | bfloat16 | 2 | 64 | 100.0 |" in text
    assert "| kvrelay pd | 50.0 | 100.0 | 2.00x |" in text  # short ITL p99 without / with
    assert "No system completed this workload." in text  # poisson
    assert "- kvrelay pd on poisson: bench serve exited 1" in text


def test_compare_arguments_and_bench_command(tmp_path):
    args = compare.parse_args(["--systems", "kvrelay-pd,llama-server", "--workloads",
                               "poisson,long+short", "--max-requests", "4", "--out",
                               str(tmp_path)])
    assert args.systems == ["kvrelay-pd", "llama-server"]
    server = compare.Server("llama-server", None, "http://127.0.0.1:9", "openai", [])
    poisson = compare.bench_command(server, "poisson", args, tmp_path, warmup=64)
    assert poisson[poisson.index("--rates") + 1] == "0.5,1,2,4"
    assert poisson[poisson.index("--warmup") + 1] == "64"
    assert poisson[poisson.index("--max-requests") + 1] == "4"
    assert "--num-requests" not in poisson  # the workload's own 64 unless asked
    args.poisson_requests = 256
    poisson = compare.bench_command(server, "poisson", args, tmp_path, warmup=64)
    assert poisson[poisson.index("--num-requests") + 1] == "256"
    long_short = compare.bench_command(server, "long+short", args, tmp_path, warmup=0)
    assert "--num-requests" not in long_short
    assert long_short[long_short.index("--rate") + 1] == "4.0"
    single = compare.bench_command(server, "single-stream", args, tmp_path, warmup=0)
    assert single[single.index("--workload") + 1] == "chat-64"
    assert single[single.index("--max-concurrency") + 1] == "1"
    assert single[single.index("--max-requests") + 1] == "4"  # the smaller of the two limits
    first = compare.free_port_block(size=5)
    assert all(compare._is_free(port) for port in range(first, first + 5))


def test_a_stopped_run_is_reported_from_what_it_left_in_its_folder(tmp_path):
    import json
    meta = {"date": "2026-11-29", "machine": "2 cores", "command": "python -m benchmarks.compare",
            "seed": 0, "warmup": 64, "slo_ttft": 2.0, "slo_tpot": 0.1, "run_errors": []}
    systems = [{"name": "kvrelay pd", "dir": "kvrelay-pd", "command": ["kvrelay", "up"],
                "info": {"version": "kvrelay abc", "dtype": "bfloat16", "threads": 2}}]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "systems.json").write_text(json.dumps(systems))
    run_dir = tmp_path / "kvrelay-pd" / "chat-64"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"runs": [_result("kvrelay pd: chat-64")]}))
    # the run was stopped before poisson, and before the next system: no files for them
    assert compare.main(["--report-from", str(tmp_path), "--no-update",
                         "--workloads", "chat-64,poisson"]) == 0
    text = (tmp_path / "comparison.md").read_text()
    assert "| kvrelay pd: chat-64 | 4 / 4 |" in text
    assert "No system completed this workload." in text
