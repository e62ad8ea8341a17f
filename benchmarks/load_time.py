"""Default-model load time: cold (GGUF dequantized and cached) and warm (from the cache).

    python benchmarks/load_time.py

Uses a fresh temporary KVRELAY_CACHE_DIR, so the first load really converts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

_LOAD = "from kvrelay.engine import LLM; LLM(dtype='bfloat16', kv_cache_memory=64 << 20)"


def timed_load(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _LOAD], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, KVRELAY_CACHE_DIR=cache, HF_HUB_OFFLINE="1")
        cold = timed_load(env)
        warm = timed_load(env)
    print(f"cold load (dequantize GGUF + cache): {cold:.1f} s, process start included")
    print(f"warm load (cached safetensors):      {warm:.1f} s, process start included")


if __name__ == "__main__":
    main()
