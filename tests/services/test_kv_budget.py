"""The KV cache's default size: a share of the memory the worker sees, bounded by what is free
(and by shared memory's room), vLLM's variable honoured, sizes with units, and a worker that
logs what it chose."""
from __future__ import annotations

import argparse

import pytest

from kvrelay.worker import flags, kv_budget
from kvrelay.worker.kv_budget import GIB, AUTO, MemoryView

MACHINE = 24 * GIB


def _machine(tmp_path, total_kib: int, available_kib: int, cgroup: dict[str, str] = {}):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:        1000 kB\n"
        f"MemAvailable:   {available_kib} kB\nHugePages_Total:       0\n")
    for name, text in cgroup.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp_path


def test_memory_view_of_a_machine_without_a_limit(tmp_path):
    root = _machine(tmp_path, 24 << 20, 20 << 20, {"memory.max": "max"})
    assert kv_budget.memory_view(root) == MemoryView(24 * GIB, 20 * GIB, "machine")


def test_memory_view_narrowed_by_a_cgroup_v2_limit(tmp_path):
    root = _machine(tmp_path, 24 << 20, 20 << 20,
                    {"memory.max": str(4 * GIB), "memory.current": str(GIB)})
    assert kv_budget.memory_view(root) == MemoryView(4 * GIB, 3 * GIB, "cgroup")


def test_memory_view_narrowed_by_a_cgroup_v1_limit(tmp_path):
    root = _machine(tmp_path, 24 << 20, 20 << 20,
                    {"memory/memory.limit_in_bytes": str(8 * GIB),
                     "memory/memory.usage_in_bytes": str(2 * GIB)})
    assert kv_budget.memory_view(root) == MemoryView(8 * GIB, 6 * GIB, "cgroup")


def test_a_v1_limit_above_the_machine_is_no_limit(tmp_path):
    root = _machine(tmp_path, 24 << 20, 20 << 20,
                    {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert kv_budget.memory_view(root).source == "machine"


def test_auto_takes_its_fraction_of_the_machine():
    budget = kv_budget.resolve(AUTO, 0.2, MemoryView(MACHINE, 20 * GIB, "machine"), environ={})
    assert budget.num_bytes == int(0.2 * MACHINE)
    assert "0.2 of the machine's 24.0 GiB" in budget.reason


def test_auto_leaves_headroom_in_what_is_available():
    budget = kv_budget.resolve(AUTO, 0.5, MemoryView(MACHINE, 6 * GIB, "machine"), environ={})
    assert budget.num_bytes == 6 * GIB - kv_budget.HEADROOM_BYTES
    assert "available" in budget.reason


def test_auto_fits_the_shared_memory_it_lives_in():
    budget = kv_budget.resolve(AUTO, 0.5, MemoryView(MACHINE, 20 * GIB, "machine"),
                               shm_free=3 * GIB, environ={})
    assert budget.num_bytes == 3 * GIB - kv_budget.HEADROOM_BYTES // 4
    assert "shared memory" in budget.reason


def test_auto_without_room_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no room for a KV cache.*--kv-cache-memory"):
        kv_budget.resolve(AUTO, 0.2, MemoryView(MACHINE, 2 * GIB, "machine"), environ={})


def test_an_explicit_size_wins_over_everything():
    budget = kv_budget.resolve(3 * GIB, 0.2, MemoryView(MACHINE, GIB, "machine"),
                               environ={kv_budget.VLLM_ENV: "8"})
    assert (budget.num_bytes, budget.reason) == (3 * GIB, "--kv-cache-memory")


def test_vllms_variable_is_read_in_gib_when_the_flag_is_unset():
    budget = kv_budget.resolve(AUTO, 0.2, MemoryView(MACHINE, 20 * GIB, "machine"),
                               environ={kv_budget.VLLM_ENV: "4"})
    assert budget.num_bytes == 4 * GIB and kv_budget.VLLM_ENV in budget.reason
    with pytest.raises(ValueError, match="whole number of GiB"):
        kv_budget.resolve(AUTO, 0.2, MemoryView(MACHINE, 20 * GIB, "machine"),
                          environ={kv_budget.VLLM_ENV: "lots"})


@pytest.mark.parametrize("text, size", [("auto", AUTO), ("AUTO", AUTO), ("1073741824", GIB),
                                        ("4GiB", 4 * GIB), ("512MiB", 512 << 20),
                                        ("2G", 2 * 10**9), ("1.5GiB", 3 * GIB // 2)])
def test_sizes_with_units(text, size):
    assert kv_budget.parse_kv_memory(text) == size


@pytest.mark.parametrize("text", ["", "lots", "4 parsecs", "-1", "0", "0.1b"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        kv_budget.parse_kv_memory(text)


def test_the_flags_default_is_auto_and_bad_values_are_usage_errors(monkeypatch, capsys):
    monkeypatch.delenv("KVRELAY_KV_CACHE_MEMORY", raising=False)
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.kv_cache_memory, args.kv_cache_memory_fraction) == (AUTO, 0.2)
    assert parser.parse_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 * GIB
    for bad in (["--kv-cache-memory", "lots"], ["--kv-cache-memory-fraction", "1.5"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "expected auto or a size" in capsys.readouterr().err


def test_a_worker_sizes_its_cache_by_default_and_says_so(tmp_path):
    """A real worker without a size (its environment too): auto, logged with its capacity."""
    import json
    import os
    import subprocess
    import sys
    import time

    from tests.e2e.stack import free_port_block

    port = free_port_block(2)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVRELAY_KV_CACHE_MEMORY", kv_budget.VLLM_ENV)}
    command = [sys.executable, "-m", "kvrelay.cli", "worker", "--role", "both", "--no-warmup",
               "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
               "--scheduler-address", f"127.0.0.1:{port + 1}",  # nobody: it keeps retrying
               "--num-threads", "1", "--kv-cache-memory-fraction", "0.01"]
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        ready = None
        while ready is None:
            assert process.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker never got ready"
            for line in log_path.read_text().splitlines():
                if '"worker ready"' in line:
                    ready = json.loads(line)
            time.sleep(0.5)
    finally:
        process.kill()
        process.wait()
    view = kv_budget.memory_view()
    assert ready["kv_cache_size"].startswith("auto: 0.01 of the ")
    assert ready["kv_capacity_tokens"] == ready["num_blocks"] * 16
    # the cache holds whole blocks of at most the budget
    assert 0 < ready["kv_cache_gib"] <= 0.01 * view.limit / GIB + 0.01
