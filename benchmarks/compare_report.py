"""The side-by-side tables of benchmarks/compare.py, and the marked section of BENCHMARKS.md
they replace (everything outside the markers stays as written by hand)."""
from __future__ import annotations

from benchmarks.summary import markdown_table
from kvrelay.bench.report import HEADER, RULE, summary_row, tagged_subsets

BEGIN = "<!-- kvrelay-compare:begin (written by `python -m benchmarks.compare`) -->"
END = "<!-- kvrelay-compare:end -->"
SECTION_TITLE = "## Side by side with the peers"


def refresh_section(document: str, body: str) -> str:
    """Replace what lies between the markers with body; without markers, append a section."""
    block = f"{BEGIN}\n{body.strip()}\n{END}"
    if BEGIN in document and END in document:
        head, rest = document.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return document.rstrip() + f"\n\n{SECTION_TITLE}\n\n{block}\n"


def systems_table(systems: list[dict]) -> str:
    rows = []
    for system in systems:
        info = system.get("info", {})
        command = " ".join(system.get("command", []))
        command = f"`{command}`" if command else "-"
        status = system.get("error", "ok").splitlines()[0][:120] if system.get("error") else "ok"
        rows.append([system["name"], info.get("version", "-"), info.get("dtype", "-"),
                     info.get("threads", "-"), command, status])
    return markdown_table(["system", "version", "dtype", "threads", "command", "status"], rows)


def memory_table(systems: list[dict]) -> str:
    """Each system's processes by peak resident memory (VmHWM), after its workloads, and how
    many tokens of KV it holds in all (benchmarks/kv_capacity.py; "-" where not read)."""
    rows = []
    for system in systems:
        memory = system.get("memory")
        if not memory:
            continue
        processes = ", ".join(f"{item['name']} {item['peak_mib']:.0f}"
                              for item in sorted(memory, key=lambda item: -item["peak_mib"]))
        total = sum(item["peak_mib"] for item in memory)
        kv_tokens = system.get("kv_capacity_tokens")
        kv_text = "-" if kv_tokens is None else f"{kv_tokens:,}"
        rows.append([system["name"], f"{total:.0f}", kv_text, processes])
    header = ["system", "peak RSS, all processes (MiB)", "KV capacity (tokens)",
              "processes (peak MiB)"]
    return markdown_table(header, rows) if rows else ""


def workload_table(results: list[tuple[str, dict]]) -> str:
    """One row per system and run of one workload (per short/long subset where tagged)."""
    lines = [HEADER, RULE]
    for system, result in results:
        for run in result["runs"]:
            label = run["label"] if run["label"].startswith(system) else f"{system}: {run['label']}"
            lines.append(summary_row(label, run["summary"]))
            for tag, summary in tagged_subsets(run):
                lines.append(summary_row(f"{label}: {tag} requests", summary))
    return "\n".join(lines)


def static_row_table(static: list[dict]) -> str:
    rows = [[item["system"], item["dtype"], item["threads"], item["requests"],
             f"{item['output_tokens_per_s']:.1f}", f"{item['wall_s']:.1f}"] for item in static]
    return markdown_table(["system", "dtype", "threads", "requests", "output tok/s", "wall s"],
                          rows)


def poisson_summary(results: list[tuple[str, dict]]) -> str:
    rows = []
    for system, result in results:
        best = (result.get("sweep") or {}).get("max_rate_goodput_90")
        rows.append([system, "none" if best is None else f"{best:g} req/s"])
    return markdown_table(["system", "highest rate with goodput >= 90%"], rows)


def long_short_summary(results: list[tuple[str, dict]]) -> str:
    rows = []
    for system, result in results:
        p99 = {run["phase"]: run["by_tag"].get("short", {}).get("itl_s", {}).get("p99")
               for run in result["runs"]}
        ratio = result.get("long_short_itl_p99_ratio")
        rows.append([system, _ms(p99.get("without long")), _ms(p99.get("with long")),
                     "-" if ratio is None else f"{ratio:.2f}x"])
    return markdown_table(["system", "short ITL p99 without long, ms", "with long, ms", "ratio"],
                          rows)


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _workload_blocks(workload: str, results: list, static: list[dict]) -> list[str]:
    blocks = [workload_table(results)] if results else []
    if workload == "chat-64" and static:
        blocks.append(static_row_table(static))
    if workload == "poisson" and results:
        blocks.append(poisson_summary(results))
    if workload == "long+short" and results:
        blocks.append(long_short_summary(results))
    return blocks


def section(meta: dict, systems: list[dict], by_workload: dict, static: list[dict]) -> str:
    """The whole generated section: how it was run, the systems, one table per workload."""
    parts = [f"Generated {meta['date']} on {meta['machine']} by:", "",
             f"```bash\n{meta['command']}\n```", "",
             *([f"Model: {meta['model']}.", ""] if meta.get("model") else []),
             "Every system ran in this one invocation, one after another, on the same workloads "
             f"(seed {meta['seed']}; `kvrelay bench serve`, streaming chat completions; each "
             f"server first got {meta['warmup']} untimed requests). SLOs for goodput: TTFT <= "
             f"{meta['slo_ttft']} s, TPOT <= {meta['slo_tpot'] * 1e3:.0f} ms.", "",
             "### Systems", "", systems_table(systems)]
    memory = memory_table(systems)
    if memory:
        parts += ["", "### Memory", "", memory]
    for workload, results in by_workload.items():
        parts += ["", f"### {workload}", ""]
        blocks = _workload_blocks(workload, results, static)
        parts.append("\n\n".join(blocks) or "No system completed this workload.")
    failures = [f"- {s['name']}: {s['error']}" for s in systems if s.get("error")]
    failures += [f"- {name} on {w}: {err}" for name, w, err in meta.get("run_errors", [])]
    if failures:
        parts += ["", "### Failures", ""] + [line.splitlines()[0] for line in failures]
    return "\n".join(parts) + "\n"
