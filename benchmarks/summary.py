"""The one place benchmarks/ gets its percentiles and markdown tables from.

`percentile` is the load tester's own (linear interpolation, q in 0-100), so a figure printed by
a script here and one printed by `kvrelay bench` mean the same thing."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvrelay.bench.metrics import percentile

__all__ = ["markdown_table", "percentile"]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub markdown table: one line per row, cells str()-ed, a '|' inside a cell escaped."""
    lines = [_line(header), "|" + "---|" * len(header)]
    lines += [_line(row) for row in rows]
    return "\n".join(lines)


def _line(cells: Sequence) -> str:
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"
