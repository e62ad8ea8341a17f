"""The `grounded` workload: requests that hand the model a passage and ask it to copy it with
a small change, or to quote from it, where speculative decoding's drafts (copied from the
prompt) pay. The passages are cut from Python's own standard library sources, which every
install has, so nothing is downloaded and the text is fixed for a given Python version."""
from __future__ import annotations

import random
import sysconfig
from pathlib import Path

# Modules whose source is plain, self-contained Python (present in every CPython install).
_SOURCES = ("textwrap.py", "colorsys.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py",
            "glob.py", "keyword.py", "string.py", "calendar.py", "fractions.py", "statistics.py",
            "difflib.py", "csv.py", "base64.py", "uu.py", "this.py", "reprlib.py", "sched.py",
            "queue.py", "graphlib.py", "numbers.py", "operator.py", "copy.py")
_TASKS = (
    "Repeat the code above exactly as it is, changing only the first function's name to "
    "add a trailing underscore.",
    "Copy the code above, word for word, but write every comment in capital letters.",
    "Quote the code above exactly, from its first line to its last.",
    "Rewrite the code above unchanged except that every 4-space indent becomes 2 spaces.",
)
PASSAGE_LINES = (25, 45)  # ~300-700 tokens of code with SmolLM2's tokenizer


def source_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in _SOURCES if (stdlib / name).is_file()]


def passage(rng: random.Random, files: list[Path]) -> str:
    lines = rng.choice(files).read_text(encoding="utf-8").splitlines()
    length = rng.randint(*PASSAGE_LINES)
    start = rng.randrange(max(1, len(lines) - length))
    return "\n".join(lines[start:start + length]).strip("\n")


def grounded(seed: int = 0, count: int = 32) -> list[list[dict]]:
    files = source_files()
    if not files:
        raise RuntimeError("no standard-library sources found for the grounded workload")
    rng = random.Random(seed)
    return [[{"role": "user",
              "content": f"```python\n{passage(rng, files)}\n```\n\n{rng.choice(_TASKS)}"}]
            for _ in range(count)]
