"""The README's python examples, read out of README.md itself: each test-run block is the fenced
python block right after a `<!-- example: NAME -->` line, so the test runs what a reader copies."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example(name: str) -> str:
    """The source of the python block marked `<!-- example: name -->`."""
    pattern = rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```"
    found = re.findall(pattern, README.read_text(), flags=re.DOTALL)
    if len(found) != 1:
        raise LookupError(f"README.md has {len(found)} python blocks marked {name!r}, not one")
    return found[0]


def run_example(source: str, timeout: float) -> subprocess.CompletedProcess:
    """Runs the source as a script of its own, as a reader would; fails on a non-zero exit."""
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
