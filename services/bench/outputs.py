"""Write a benchmark's result: JSON, the markdown table, and the plots, into one folder."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from kvrelay.bench import report


def command_line() -> str:
    """The command as the user typed it (`python -m kvrelay.cli` reads as `kvrelay`)."""
    if Path(sys.argv[0]).name in ("kvrelay", "cli.py"):
        return "kvrelay " + shlex.join(sys.argv[1:])
    return shlex.join(sys.argv)


def write_outputs(result: dict, records: list, out: Path) -> dict:
    """records: (label, [RequestRecord]) per run, for the latency CDFs. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "result.json", "markdown": out / "results.md"}
    files.update(_plots(result, records, out))
    result["files"] = {name: str(path) for name, path in files.items()}
    files["json"].write_text(json.dumps(result, indent=1))
    files["markdown"].write_text(report.markdown(result))
    print(f"wrote {', '.join(result['files'].values())}", file=sys.stderr)
    return result["files"]


def _plots(result: dict, records: list, out: Path) -> dict:
    try:  # matplotlib loads only when there is something to draw
        from kvrelay.bench import plots
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return {}
    files = {"latency_cdf": plots.latency_cdfs(records, out / "latency_cdf.png")}
    if result.get("sweep"):
        files["rate_sweep"] = plots.rate_sweep(result["sweep"]["points"],
                                               out / "rate_sweep.png")
    return files
